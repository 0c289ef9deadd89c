"""Guards on request bodies and Host names: what a cross-site page could otherwise send.

An open Detour on loopback is reachable from any web page the producer's host opens: a
form or ``fetch`` can POST there without a CORS preflight as long as the body is
``text/plain``, form-encoded or multipart, and a page whose own name resolves to
127.0.0.1 (DNS rebinding) can even read the answers. So (docs/security.md, "The HTTP
edge"): a body must say ``application/json`` (which no page can send cross-site without
a preflight, and Detour answers none), a JSON object may not repeat a key (a form field
``{"brokerName":"=","brokerName":"broker-a",...}`` would otherwise take the last), and a
Host must be a loopback name, an IP literal or a configured name.

And bodies are bounded in size (``BodyLimit``).
"""

from __future__ import annotations

import ipaddress
import json
import re
import resource
from collections.abc import Iterable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import error_body


class BadBody(HTTPException):
    """A body refused before validation, naming the field (rendered by api/errors.py)."""

    def __init__(self, status: int, message: str, field: str) -> None:
        super().__init__(status, message)
        self.field = field


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


def has_body(headers: Iterable[tuple[bytes, bytes]]) -> tuple[bool, bytes | None]:
    """Whether the request carries a body, and its Content-Type."""
    has_body = False
    content_type = None
    for name, value in headers:
        if name == b"content-type":
            content_type = value
        elif name == b"content-length":
            has_body = value.strip() != b"0"
        elif name == b"transfer-encoding":
            has_body = True
    return has_body, content_type


def is_json(content_type: bytes | None) -> bool:
    """``application/json``, any parameters (``; charset=utf-8``), any case."""
    if content_type is None:
        return False
    return content_type.partition(b";")[0].strip().lower() == b"application/json"


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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.overrides.get(scope["path"], self.max_bytes)
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_large = int(value) > limit
                except ValueError:
                    too_large = False
                if too_large:
                    await self.reject(send, limit)
                    return
                break

        received = 0

        async def limited_receive() -> Message:
            # A chunked body has no length up front: count it as it is read. The
            # HTTPException travels through the framework to the error handler.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, f"request body over {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)

    async def reject(self, send: Send, limit: int) -> None:
        body = json.dumps(
            error_body("PAYLOAD_TOO_LARGE", f"request body over {limit} bytes", "body")
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class JsonBodies:
    """Every request body is JSON: 415 for any other (or no) Content-Type, 422 naming the
    field for a repeated key. The one content-type policy of the API (the framework's
    strict check then never sees anything else).

    Pure ASGI: it sits on the /select hot path. The repeated-key check runs on the body
    as the handler reads it (bounded by the body limit), so a refused request costs no
    read of its own.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        body = json.dumps(
            error_body(
                "UNSUPPORTED_MEDIA_TYPE",
                "request bodies are JSON: send Content-Type: application/json",
                "Content-Type",
            )
        ).encode()
        self.refusal_start: Message = {
            "type": "http.response.start",
            "status": 415,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
        self.refusal_body: Message = {"type": "http.response.body", "body": body}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        expected, content_type = has_body(scope["headers"])
        if not expected:
            await self.app(scope, receive, send)
            return
        if not is_json(content_type):
            await send(self.refusal_start)
            await send(self.refusal_body)
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
                    body = b"".join(chunks) if chunks else chunk
                    field = duplicate_key(body) if body else None
                    if field is not None:
                        raise BadBody(422, f"{field}: repeated key in a JSON object", field)
            return message

        await self.app(scope, checked_receive, send)


def _host_name(value: bytes) -> str:
    """The name of a Host header value, without its port, lower case."""
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostNames:
    """Which Host names requests may carry: loopback names (``localhost``, ``*.localhost``),
    any IP literal (a rebinding page always sends a name: its own), and the configured
    names; ``*`` allows any."""

    def __init__(self, configured: Iterable[str]) -> None:
        names = {n.strip().lower().rstrip(".") for n in configured if n.strip()}
        self.any = "*" in names
        self.names = frozenset(names - {"*"})

    @classmethod
    def parse(cls, setting: str | None, bind_host: str) -> HostNames:
        """From ``DETOUR_ALLOWED_HOSTS`` (comma-separated) plus the bound host, if a name."""
        return cls([*(setting or "").split(","), bind_host])

    def allows(self, value: bytes) -> bool:
        if self.any:
            return True
        name = _host_name(value).rstrip(".")
        if name == "localhost" or name.endswith(".localhost") or name in self.names:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def connection_bound(wanted: int, reserve: int = 128) -> int:
    """``wanted`` connections, or fewer when the process may not open that many files
    (keeping ``reserve`` for Redis connections, logs and the listener). The soft limit is
    raised toward the hard one first, as nginx's ``worker_rlimit_nofile`` does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + reserve
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - reserve))
