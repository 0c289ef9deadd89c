"""A total deadline for a blocking httpx call, which httpx itself does not have.

httpx's timeouts bound each socket operation, so a server that trickles a byte
every 100 ms never trips a 200 ms read timeout: a send took 33.6 s that way
(encode/httpx#1450). The async client wraps each call in ``asyncio.timeout``; a
blocking call cannot be cancelled from outside, so here every socket operation
is given the time left until the call's deadline instead of the full timeout.

``DeadlineTransport`` is an httpx transport over an httpcore connection pool
whose network backend does that; ``call_deadline`` sets the deadline for the
calls made in its block, in this thread (a ``ContextVar``: each thread has its
own, so concurrent producers do not share one). Headers and body are both read
through the backend, so both are bounded; so are connecting and the pool wait
(the latter by the per-request timeout the caller passes).

Environment proxies (``HTTP_PROXY``) are not used: Detour is a sidecar or a
service in the cluster, and a loopback call sent through a corporate proxy is a
misconfiguration, not a route. ``SSL_CERT_FILE``/``SSL_CERT_DIR`` are honoured.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

#: Monotonic seconds by which the current blocking call must be over; None = no deadline.
_ENDS: ContextVar[float | None] = ContextVar("detour_call_ends", default=None)


@contextmanager
def call_deadline(seconds: float) -> Iterator[None]:
    """Calls made through a ``DeadlineTransport`` in this block end within ``seconds``."""
    token = _ENDS.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _ENDS.reset(token)


def _capped(timeout: float | None, expired: type[httpcore.TimeoutException]) -> float | None:
    """``timeout`` cut to the time left before the deadline; raises ``expired`` past it."""
    ends = _ENDS.get()
    if ends is None:
        return timeout
    left = ends - time.monotonic()
    if left <= 0:
        raise expired("the call's total deadline has passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _capped(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _capped(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        timeout = _capped(timeout, httpcore.ConnectTimeout)
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        timeout = _capped(timeout, httpcore.ConnectTimeout)
        return _Stream(self._inner.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        timeout = _capped(timeout, httpcore.ConnectTimeout)
        return _Stream(self._inner.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _as_httpx(exc: Exception) -> httpx.TransportError:
    """httpcore's error as the httpx error of the same name (httpx defines one for each)."""
    cls = getattr(httpx, type(exc).__name__, None)
    if not (isinstance(cls, type) and issubclass(cls, httpx.TransportError)):
        cls = httpx.TransportError
    return cls(str(exc))


class _Body(httpx.SyncByteStream):
    def __init__(self, stream: Iterable[bytes]) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._stream
        except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise _as_httpx(exc) from exc

    def close(self) -> None:
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()


class DeadlineTransport(httpx.BaseTransport):
    """httpx's default transport, reduced to what the SDK uses (HTTP/1.1, TLS, a pool),
    with every socket operation bounded by ``call_deadline``. Public APIs only:
    httpx accepts any ``BaseTransport``, httpcore any ``NetworkBackend``."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=True),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_Backend(),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, Iterable)
        url = request.url
        req = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        try:
            resp = self._pool.handle_request(req)
        except (
            httpcore.TimeoutException,
            httpcore.NetworkError,
            httpcore.ProtocolError,
            httpcore.UnsupportedProtocol,
        ) as exc:
            raise _as_httpx(exc) from exc
        assert isinstance(resp.stream, Iterable)
        return httpx.Response(
            status_code=resp.status,
            headers=resp.headers,
            stream=_Body(resp.stream),
            extensions=resp.extensions,
        )

    def close(self) -> None:
        self._pool.close()
