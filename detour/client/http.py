"""Calls to Detour over httpx, sorted into "answered" and "unavailable".

Everything the fail-open rule needs to know about a call is decided here, the
same way for the sync and async clients:

* a timeout (of the whole call, headers and body: ``detour.client.deadline``),
  a refused or reset connection, a 5xx (503 is Detour shedding load or its store
  being down) or a 429: ``DetourUnavailable``;
* 401, 403 or a 3xx: ``DetourRejected``. A rotated token or a proxy's redirect
  must not stop a producer; the client decides locally and says so loudly;
* a 2xx that is not the answer Detour sends (not ``application/json``, not JSON, JSON
  that repeats a key, a list, empty, an unknown decision, a bad queueId, more than
  ``MAX_ANSWER_BYTES`` on the wire), an answer with a ``Content-Encoding`` other than
  ``identity`` (``check_encoding``), or a 4xx without
  Detour's error body, exactly (``wire.is_error_body``: a proxy's page, or a gateway's
  own JSON): ``DetourBadAnswer``;

and the client falls back to its local table for all three. Only a 4xx with
Detour's error body is raised as ``DetourRequestError`` (``TopicNotFound`` for a
select's 404), because retrying a wrong request elsewhere would hide a
programming mistake.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any, TypeVar

import httpx

from detour.client import wire
from detour.client.deadline import DeadlineTransport, call_deadline
from detour.client.errors import (
    DetourBadAnswer,
    DetourRejected,
    DetourRequestError,
    DetourUnavailable,
)

USER_AGENT = "detour-python/0.1"
#: Detour's largest answer is a batch's results (about 250 KB for 1,000 reports); more
#: than this is not Detour, and is not read into the producer's memory.
MAX_ANSWER_BYTES = 4 * 1024 * 1024
LIMITS = httpx.Limits(max_connections=64, max_keepalive_connections=16)

T = TypeVar("T")
#: Turns an answer's JSON into what the caller wants; anything it raises makes the answer bad.
Parse = Callable[[Any], T]


def headers(token: str | None) -> dict[str, str]:
    # identity: a compressed answer could inflate past every bound before it is counted.
    out = {"User-Agent": USER_AGENT, "Accept": "application/json", "Accept-Encoding": "identity"}
    if token:
        out["Authorization"] = f"Bearer {token}"
    return out


def check_encoding(response: httpx.Response, what: str) -> None:
    """Raises DetourBadAnswer when the answer declares a ``Content-Encoding`` other than
    ``identity``, before a byte of its body is read.

    Why: the SDK asks for ``identity`` and Detour never compresses, but httpx decodes any
    encoding an answer declares, and a 2 KB gzip bomb inflates to gigabytes, past every
    bound, holding the send (and the async client's event loop) for seconds. Bodies are
    then read raw (``iter_raw``), so the byte bounds count what came over the wire. The one
    rule for every answer: calls (``SyncHTTP``, ``AsyncHTTP``) and the event stream."""
    encoding = response.headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise DetourBadAnswer(
            f"{what}: HTTP {response.status_code} with Content-Encoding {encoding[:50]!r}, "
            "not identity: not read"
        )


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; raises ValueError when a key repeats (Detour never
    sends one; with the last one winning, a repeated key could pair one broker's name with
    another's address)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is repeated")
        out[key] = value
    return out


def _json_answer(response: httpx.Response, content: bytes) -> Any:
    """A 2xx's JSON: Detour answers ``application/json``, each key once. Extra, unknown
    fields are accepted (a newer Detour may add some); the parse decides the rest."""
    kind = response.headers.get("content-type", "")
    if kind.split(";", 1)[0].strip().lower() != "application/json":
        raise ValueError(f"content type {kind[:100] or 'none'!r}, not application/json")
    return json.loads(content, object_pairs_hook=_no_repeats)


def json_object(body: Any) -> Mapping[str, Any]:
    """Every Detour answer is a JSON object; raises TypeError for anything else."""
    if not isinstance(body, Mapping):
        raise TypeError(f"expected a JSON object, got {type(body).__name__}")
    return body


def check_rejected(response: httpx.Response, what: str) -> None:
    """Raises DetourRejected for 401, 403 and any 3xx."""
    status = response.status_code
    if status in (401, 403):
        raise DetourRejected(
            status, f"{what}: HTTP {status}: Detour refused the token; check the client's token"
        )
    if 300 <= status < 400:
        to = response.headers.get("location", "nowhere")
        raise DetourRejected(
            status, f"{what}: HTTP {status} to {to[:200]}: not followed; check the client's url"
        )


def interpret(response: httpx.Response, content: bytes, what: str, parse: Parse[T]) -> T:
    """The parsed answer; raises as the module docstring says."""
    status = response.status_code
    if 200 <= status < 300:
        try:
            return parse(_json_answer(response, content))
        except Exception as exc:  # noqa: BLE001 - whatever a bad answer makes parsing raise
            raise DetourBadAnswer(
                f"{what}: HTTP {status} but not Detour's answer: {type(exc).__name__}: "
                f"{str(exc)[:200]}"
            ) from exc
    check_rejected(response, what)
    if status >= 500 or status == 429:
        raise DetourUnavailable(f"{what}: HTTP {status}")
    try:
        body: object = json.loads(content)
    except (ValueError, RecursionError):
        body = None
    if not wire.is_error_body(body):
        raise DetourBadAnswer(f"{what}: HTTP {status} without Detour's error body (a proxy?)")
    code, message, field = wire.error_fields(body)
    raise DetourRequestError(status, code, message, field)


def check_stream(response: httpx.Response, what: str) -> None:
    """Raises unless ``response`` is an event stream: DetourRejected (401/403/3xx),
    DetourBadAnswer (200 but not ``text/event-stream``), else DetourUnavailable."""
    status = response.status_code
    if status == 200:
        check_encoding(response, what)
        kind = response.headers.get("content-type", "")
        if not kind.startswith("text/event-stream"):
            raise DetourBadAnswer(f"{what}: HTTP 200 but {kind or 'no content type'}")
        return
    check_rejected(response, what)
    raise DetourUnavailable(f"{what}: HTTP {status}")


def _too_large(response: httpx.Response, what: str) -> DetourBadAnswer:
    return DetourBadAnswer(
        f"{what}: HTTP {response.status_code} answer over {MAX_ANSWER_BYTES} bytes"
    )


def _declared_too_large(response: httpx.Response) -> bool:
    length = response.headers.get("content-length", "")
    return length.isdigit() and int(length) > MAX_ANSWER_BYTES


def _read(response: httpx.Response, chunks: Iterator[bytes], what: str) -> bytes:
    """The body, from ``response.iter_raw()``: at most ``MAX_ANSWER_BYTES`` on the wire."""
    check_encoding(response, what)
    if _declared_too_large(response):
        raise _too_large(response, what)
    buf = bytearray()
    for chunk in chunks:
        buf += chunk
        if len(buf) > MAX_ANSWER_BYTES:
            raise _too_large(response, what)
    return bytes(buf)


async def _aread(response: httpx.Response, chunks: AsyncIterator[bytes], what: str) -> bytes:
    """As ``_read``, from ``response.aiter_raw()``."""
    check_encoding(response, what)
    if _declared_too_large(response):
        raise _too_large(response, what)
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        if len(buf) > MAX_ANSWER_BYTES:
            raise _too_large(response, what)
    return bytes(buf)


def _unavailable(what: str, exc: Exception, budget: float) -> DetourUnavailable:
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return DetourUnavailable(f"{what}: no answer within {budget:.3g} s")
    return DetourUnavailable(f"{what}: {type(exc).__name__}: {exc}")


class SyncHTTP:
    """One pooled ``httpx.Client`` (keep-alive connections, shareable between threads).

    Each call ends within its budget (default ``timeout``, s), connecting, headers
    and body included, however slowly the server writes (``DeadlineTransport``).
    ``transport`` replaces that transport (then only httpx's per-operation
    timeouts apply).
    """

    def __init__(
        self,
        base_url: str,
        timeout: float,
        token: str | None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.timeout = timeout
        self.client = httpx.Client(
            base_url=base_url,
            timeout=httpx.Timeout(timeout),
            headers=headers(token),
            transport=transport or DeadlineTransport(LIMITS),
        )

    def call(
        self,
        method: str,
        path: str,
        body: object = None,
        parse: Parse[T] = json_object,  # type: ignore[assignment]
        budget: float | None = None,
    ) -> T:
        """The parsed answer within ``budget`` seconds (default the timeout). Raises
        DetourUnavailable (or a subclass) or DetourRequestError: see the module docstring."""
        budget = self.timeout if budget is None else budget
        what = f"{method} {path}"
        try:
            with (
                call_deadline(budget),
                self.client.stream(method, path, timeout=budget, **_body(body)) as response,
            ):
                content = _read(response, response.iter_raw(), what)
        except httpx.HTTPError as exc:
            raise _unavailable(what, exc, budget) from exc
        return interpret(response, content, what, parse)

    def close(self) -> None:
        self.client.close()


def _body(body: object) -> dict[str, Any]:
    """httpx's arguments for ``body``: bytes are JSON encoded already (a report batch,
    ``wire.batch_text``), anything else is encoded here."""
    if isinstance(body, bytes):
        return {"content": body, "headers": _JSON}
    return {"json": body}


_JSON = {"Content-Type": "application/json"}


class AsyncHTTP:
    """One pooled ``httpx.AsyncClient``; each call ends within its budget (default
    ``timeout``, s), headers and body included (``asyncio.timeout``)."""

    def __init__(
        self,
        base_url: str,
        timeout: float,
        token: str | None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.timeout = timeout
        # An explicit transport, as the sync client's: environment proxies are not used.
        self.client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(timeout),
            headers=headers(token),
            transport=transport or httpx.AsyncHTTPTransport(limits=LIMITS),
        )

    async def call(
        self,
        method: str,
        path: str,
        body: object = None,
        parse: Parse[T] = json_object,  # type: ignore[assignment]
        budget: float | None = None,
    ) -> T:
        """As ``SyncHTTP.call``."""
        budget = self.timeout if budget is None else budget
        what = f"{method} {path}"
        try:
            async with (
                asyncio.timeout(budget),
                self.client.stream(method, path, timeout=budget, **_body(body)) as response,
            ):
                content = await _aread(response, response.aiter_raw(), what)
        except (TimeoutError, httpx.HTTPError) as exc:
            raise _unavailable(what, exc, budget) from exc
        return interpret(response, content, what, parse)

    async def aclose(self) -> None:
        await self.client.aclose()
