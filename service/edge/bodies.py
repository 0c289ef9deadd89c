"""Guards on request bodies: what a cross-site page could otherwise send, and how much.

An open Detour on loopback is reachable from any web page the producer's host opens: a
form or ``fetch`` can POST there without a CORS preflight as long as the body is
``text/plain``, form-encoded or multipart. So (docs/security.md, "The HTTP edge"): a body
must say ``application/json`` (which no page can send cross-site without a preflight, and
Detour answers none), and a JSON object may not repeat a key (a form field
``{"brokerName":"=","brokerName":"broker-a",...}`` would otherwise take the last).
Bodies are bounded in size (``BodyLimit``). Host names are ``service.edge.hosts``'.

The repeated-key check is ``check_keys``, here only: ``JsonBodies`` runs it on the ASGI
way in, the direct lane (service/edge/direct.py) on the body it holds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import BadBody
from service.edge import answers


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Duplicate
    return obj


class _Pairs(list[tuple[str, Any]]):
    """A JSON object as parsed, keys in order and repeated ones kept."""


def _first_duplicate(node: Any, path: str) -> str | None:
    if isinstance(node, _Pairs):
        seen: set[str] = set()
        for key, value in node:
            here = f"{path}.{key}" if path else key
            if key in seen:
                return here
            seen.add(key)
            found = _first_duplicate(value, here)
            if found is not None:
                return found
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found = _first_duplicate(value, f"{path}[{i}]")
            if found is not None:
                return found
    return None


#: A key in a JSON text without backslashes: a string followed by a colon. (Without
#: backslashes no string holds a quote, so the strings pair up left to right and only keys
#: are followed by a colon.)
_KEY = re.compile(rb'"([^"]*)"\s*:')


def duplicate_key(body: bytes) -> str | None:
    """The path of the first key a JSON object in ``body`` repeats (``reports[0].brokerName``),
    or None: none repeats, or the body is not JSON (the handler's validation says so)."""
    if b"\\" not in body:
        # The common case, cheaply: no key text occurs twice anywhere, so no object
        # repeats one (a select body: a few µs less than parsing it).
        keys = _KEY.findall(body)
        if len(keys) == len(set(keys)):
            return None
    try:
        json.loads(body, object_pairs_hook=_no_duplicates)
        return None
    except _Duplicate:
        pass
    except (ValueError, RecursionError):
        return None
    return _first_duplicate(json.loads(body, object_pairs_hook=_Pairs), "")


def check_keys(body: bytes) -> None:
    """Raises BadBody (422, naming the path) when a JSON object in ``body`` repeats a key."""
    field = duplicate_key(body) if body else None
    if field is not None:
        raise BadBody(422, f"{field}: repeated key in a JSON object", field)


#: A Content-Type sent more than once: no type (RFC 9110 section 8.3 allows one; two can say
#: two things, and the two ways in once read different ones).
REPEATED = b""


def one_type(seen: bytes | None, value: bytes) -> bytes:
    """The request's Content-Type after another such header with ``value``: ``REPEATED``
    from the second on (``is_json`` is then False)."""
    return value if seen is None else REPEATED


def has_body(headers: Iterable[tuple[bytes, bytes]]) -> tuple[bool, bytes | None]:
    """Whether the request carries a body, and its Content-Type (``REPEATED``: twice)."""
    has_body = False
    content_type = None
    for name, value in headers:
        if name == b"content-type":
            content_type = one_type(content_type, value)
        elif name == b"content-length":
            has_body = value.strip() != b"0"
        elif name == b"transfer-encoding":
            has_body = True
    return has_body, content_type


def is_json(content_type: bytes | None) -> bool:
    """``application/json`` (or ``application/merge-patch+json``, RFC 7396's JSON for
    ``PATCH /config``), any parameters (``; charset=utf-8``), any case."""
    if content_type is None:
        return False
    return content_type.partition(b";")[0].strip().lower() in (
        b"application/json",
        b"application/merge-patch+json",
    )


class BodyLimit:
    """413 when Content-Length says too much, or once a streamed body passes the limit.

    Pure ASGI rather than BaseHTTPMiddleware: it sits on the /select hot path. Not
    Starlette's ``max_body_size`` (Starlette 1.10 has it): when Content-Length is over the
    limit, that replaces whatever the app answers with its own ``text/plain`` 413, and
    Detour's contract is the Error schema on every error.
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, overrides: Mapping[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        #: path -> its own limit (the batch endpoint takes more)
        self.overrides = dict(overrides or {})

    def limit(self, path: str) -> int:
        return self.overrides.get(path, self.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit(scope["path"])
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    over = int(value) > limit
                except ValueError:
                    over = False
                if over:
                    message = f"request body over {limit} bytes"
                    await answers.send_error(
                        send, 413, "PAYLOAD_TOO_LARGE", message, "body", (answers.CLOSE,)
                    )
                    return
                break

        received = 0

        async def limited_receive() -> Message:
            # A chunked body has no length up front: count it as it is read. The error
            # travels through the framework to its handler.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BadBody(413, f"request body over {limit} bytes", "body")
            return message

        await self.app(scope, limited_receive, send)


class JsonBodies:
    """Every request body is JSON: 415 for any other (or no) Content-Type, 422 naming the
    field for a repeated key (``check_keys``). The one content-type policy of the API (the
    framework's strict check then never sees anything else).

    Pure ASGI: it sits on the ASGI way to every route. The repeated-key check runs on the
    body as the handler reads it (bounded by the body limit), so a refused request costs
    no read of its own.
    """

    REFUSAL = answers.asgi_error(
        415,
        "UNSUPPORTED_MEDIA_TYPE",
        "request bodies are JSON: send Content-Type: application/json",
        "Content-Type",
    )

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        expected, content_type = has_body(scope["headers"])
        if not expected:
            await self.app(scope, receive, send)
            return
        if not is_json(content_type):
            await send(self.REFUSAL[0])
            await send(self.REFUSAL[1])
            return
        chunks: list[bytes] = []

        async def checked_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                more = message.get("more_body", False)
                if more or chunks:
                    chunks.append(chunk)
                if not more:
                    check_keys(b"".join(chunks) if chunks else chunk)
            return message

        await self.app(scope, checked_receive, send)
