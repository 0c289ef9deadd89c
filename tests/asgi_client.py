"""Starlette's TestClient, with a request and its whole answer in one hop to the app's loop.

Starlette's transport runs the app on a loop in another thread and crosses to it for every
step of a request (events, the app task, each body chunk): about eight crossings, some
3-4 ms of CPU for a request whose handling costs the app a tenth of that, and the suite
sends thousands. This transport makes one crossing: it hands the loop the request's bytes,
lets the app answer, and takes the whole answer back. The app sees the same ASGI scope and
messages (a disconnect only after its answer is complete), and an exception it raises is
raised here as Starlette's client raises it.

What it cannot do in one crossing goes Starlette's way, unchanged: a request body sent as
a stream, and answers that never end (``/fault-items/stream``), whose chunks a test reads
while they come.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import anyio
import starlette.testclient as _starlette
from starlette.types import Message

httpx = _starlette.httpx

#: Paths whose answers stream until the client leaves: Starlette's transport reads them.
ENDLESS = ("/fault-items/stream",)


class _OneHopTransport(_starlette._TestClientTransport):
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not isinstance(request.stream, httpx.ByteStream) or request.url.path in ENDLESS:
            return super().handle_request(request)
        scope = self._scope(request)
        body = request.read()
        with self.portal_factory() as portal:
            status, headers, chunks, error = portal.call(_exchange, self.app, scope, body)
        if error is not None and self.raise_server_exceptions:
            raise error
        if status is None:
            if self.raise_server_exceptions:
                raise AssertionError("TestClient did not receive any response.")
            status, headers, chunks = 500, [], []
        content = b"" if request.method == "HEAD" else b"".join(chunks)
        return httpx.Response(
            status_code=status,
            headers=[(k.decode(), v.decode()) for k, v in headers],
            stream=httpx.ByteStream(content),
            request=request,
        )

    def _scope(self, request: httpx.Request) -> dict[str, Any]:
        """The scope Starlette's transport builds for an HTTP request."""
        url = request.url
        port = url.port or {"http": 80, "https": 443}[url.scheme]
        headers: list[tuple[bytes, bytes]] = (
            [] if "host" in request.headers else [(b"host", url.netloc)]
        )
        headers += [(k.lower().encode(), v.encode()) for k, v in request.headers.multi_items()]
        return {
            "type": "http",
            "http_version": "1.1",
            "method": request.method,
            "path": unquote(url.path),
            "raw_path": url.raw_path.split(b"?", 1)[0],
            "root_path": self.root_path,
            "scheme": url.scheme,
            "query_string": url.query,
            "headers": headers,
            "client": self.client,
            "server": [url.raw_host.decode("ascii"), port],
            "extensions": {"http.response.debug": {}, "http.response.trailers": {}},
            "state": self.app_state.copy(),
        }


async def _exchange(
    app: Any, scope: dict[str, Any], body: bytes
) -> tuple[int | None, list[tuple[bytes, bytes]], list[bytes], BaseException | None]:
    """Run ``app`` for one request on this loop: (status, headers, body chunks, error)."""
    sent = False
    complete = anyio.Event()
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = []
    chunks: list[bytes] = []
    trailers = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body}
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, headers, trailers
        kind = message["type"]
        if kind == "http.response.start":
            assert status is None, 'Received multiple "http.response.start" messages.'
            status, headers = message["status"], list(message.get("headers", []))
            trailers = bool(message.get("trailers", False))
        elif kind == "http.response.body":
            assert status is not None, 'Received "http.response.body" without "start".'
            assert not complete.is_set(), 'Received "http.response.body" after completion.'
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False) and not trailers:
                complete.set()
        elif kind == "http.response.trailers" and not message.get("more_trailers", False):
            complete.set()

    error: BaseException | None = None
    try:
        await app(scope, receive, send)
    except Exception as exc:  # raised by the caller, as Starlette's client does
        error = exc
    finally:
        complete.set()
    return status, headers, chunks, error


class TestClient(_starlette.TestClient):
    """``fastapi.testclient.TestClient`` with the one-hop transport."""

    __test__ = False

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(app, *args, **kwargs)
        old = self._transport
        assert isinstance(old, _starlette._TestClientTransport)
        self._transport = _OneHopTransport(
            old.app,
            portal_factory=old.portal_factory,
            raise_server_exceptions=old.raise_server_exceptions,
            root_path=old.root_path,
            app_state=old.app_state,
            client=old.client,
        )
