"""ASGI guards at the edge: bodies are JSON whatever the header says, and bounded in size."""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import error_body


class BodyLimit:
    """413 when Content-Length says too much, or once a streamed body passes the limit.

    Pure ASGI rather than BaseHTTPMiddleware: it sits on the /select hot path.
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
                    await self._reject(send, limit)
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

    async def _reject(self, send: Send, limit: int) -> None:
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


class AssumeJson:
    """Read every request body as JSON: Detour's API takes nothing else.

    ``curl -d`` sends ``application/x-www-form-urlencoded`` and ``fetch`` with a
    string body sends ``text/plain``; refusing those would fail producers over a
    header. The body is still validated as JSON, field by field.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            headers.append((b"content-type", b"application/json"))
            # In place, not a copy: outer middleware reads what routing adds to the
            # scope (the request timer labels by scope["route"]).
            scope["headers"] = headers
        await self.app(scope, receive, send)
