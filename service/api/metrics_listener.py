"""A second listener that answers ``GET /metrics`` and nothing else, with its own tokens.

Why: in the sidecar shape Detour listens on the pod's loopback, without tokens, for its one
producer, and no Prometheus can reach it, so the per-process alerts (a replica without
Redis, its journal dropping reports) were blind there. ``DETOUR_METRICS_HOST`` (the pod IP)
and ``DETOUR_METRICS_PORT`` put ``/metrics`` on an address Prometheus reaches, while the
main listener stays on loopback. Scrapes need a ``metrics`` (or ``admin``) token from
``DETOUR_METRICS_TOKENS_FILE`` (the tokens-file format of docs/security.md; without it, the
main tokens), and see what the main ``/metrics`` would show that token. The rendering is the
app's own ``Exposition``: at most one per ``DETOUR_METRICS_CACHE_S`` whichever listener asks.

Plain asyncio, no framework: a request head is read (bounded in size and time), a bounded
number of connections are served at once, nothing is ever read past the head, and the
connection is kept open for the next scrape as HTTP/1.1 allows.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST

from service.api.exposition import Exposition
from service.auth import TokenTable, is_loopback, load_tokens, parse_tokens
from service.errors import error_body
from service.settings import Settings
from service.store import FaultStore

log = logging.getLogger("detour")

PATH = "/metrics"
#: Largest request head read (bytes): a scrape's is a few hundred.
MAX_HEAD_BYTES = 8192
#: Scrapes served at once; a connection past it is closed at once (Prometheus keeps one
#: per target, so a handful covers a second Prometheus and a person with curl).
MAX_CONNECTIONS = 8
#: Requests on one kept-alive connection before it is closed (Prometheus reconnects).
MAX_REQUESTS = 1000


def metrics_tokens(settings: Settings, tokens: TokenTable) -> TokenTable:
    """Who may scrape the metrics listener: ``metrics_tokens_file`` when set, else the main
    tokens. Raises ValueError for a file that cannot be read or parsed."""
    if not settings.metrics_tokens_file:
        return tokens
    path = settings.metrics_tokens_file
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    return parse_tokens(text, path, serves_namespaces=False)


def metrics_refusal(settings: Settings, tokens: TokenTable | None = None) -> str | None:
    """Why the metrics listener cannot start as configured, or None (also when it is off).

    Raises ValueError when a tokens file cannot be read."""
    if settings.metrics_host is None:
        return None
    if settings.metrics_host == settings.host and settings.metrics_port == settings.port:
        return (
            f"DETOUR_METRICS_PORT {settings.metrics_port} is the main listener's port on the "
            "same host: give the metrics listener a port of its own"
        )
    allowed = metrics_tokens(settings, load_tokens(settings) if tokens is None else tokens)
    if allowed or settings.allow_open or is_loopback(settings.metrics_host):
        return None
    return (
        f"refusing to serve /metrics on {settings.metrics_host} with no tokens: set "
        "DETOUR_METRICS_TOKENS_FILE (a tokens file with a metrics token), or pass "
        "--allow-open (DETOUR_ALLOW_OPEN=true) to let anyone who reaches it scrape"
    )


@dataclass
class _Request:
    method: str
    path: str
    version: str
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def keep_alive(self) -> bool:
        connection = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return connection == "keep-alive"
        return connection != "close"


def _parse(head: bytes) -> _Request | None:
    """The request line and headers, or None when malformed."""
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        return None
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        return None
    request = _Request(method, target.split("?", 1)[0], version)
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            return None
        request.headers[name.strip().lower()] = value.strip()
    return request


def _response(
    status: int, reason: str, body: bytes, content_type: str, keep_alive: bool, *extra: str
) -> bytes:
    head = [
        f"HTTP/1.1 {status} {reason}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def _error(status: int, reason: str, code: str, message: str, *extra: str) -> bytes:
    body = json.dumps(error_body(code, message)).encode()
    return _response(status, reason, body, "application/json", False, *extra)


class MetricsListener:
    """The listener; ``start`` binds it, ``close`` stops it and drops its connections."""

    def __init__(
        self,
        exposition: Exposition,
        stores: Mapping[str, FaultStore],
        tokens: TokenTable,
        head_timeout_s: float = 5.0,
    ) -> None:
        self._exposition = exposition
        self._stores = stores
        self._tokens = tokens
        self._head_timeout_s = head_timeout_s
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        #: Connections closed at once because MAX_CONNECTIONS were open (tests).
        self.refused = 0

    async def start(self, host: str, port: int) -> None:
        # reuse_port: with several uvicorn workers each binds it and the kernel spreads the
        # scrapes; any worker's answer adds up all of them (multiprocess mode).
        self._server = await asyncio.start_server(
            self._serve, host, port, limit=MAX_HEAD_BYTES, reuse_port=True
        )

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._open):
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= MAX_CONNECTIONS:
            self.refused += 1
            writer.close()
            return
        self._open.add(writer)
        try:
            for _ in range(MAX_REQUESTS):
                try:
                    head = await asyncio.wait_for(
                        reader.readuntil(b"\r\n\r\n"), self._head_timeout_s
                    )
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                    return  # the client went away, sent too much, or nothing in time
                answer, keep_alive = await self._answer(_parse(head))
                writer.write(answer)
                await asyncio.wait_for(writer.drain(), self._head_timeout_s)
                if not keep_alive:
                    return
        except (ConnectionError, TimeoutError):
            return
        finally:
            self._open.discard(writer)
            writer.close()

    async def _answer(self, request: _Request | None) -> tuple[bytes, bool]:
        """The response and whether the connection stays open."""
        if request is None:
            return _error(400, "Bad Request", "BAD_REQUEST", "not an HTTP/1.x request"), False
        if "transfer-encoding" in request.headers or request.headers.get(
            "content-length", "0"
        ) not in ("", "0"):
            # Nothing past the head is read: a body would be taken for the next request.
            return _error(400, "Bad Request", "BAD_REQUEST", "a scrape has no body"), False
        if request.path != PATH:
            return _error(404, "Not Found", "NOT_FOUND", f"this listener serves {PATH} only"), False
        if request.method != "GET":
            return _error(
                405, "Method Not Allowed", "METHOD_NOT_ALLOWED", "GET only", "Allow: GET"
            ), False
        namespaces: frozenset[str] | None = None
        if self._tokens:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            principal = (
                self._tokens.lookup(token.strip())
                if scheme.lower() == "bearer" and token.strip()
                else None
            )
            if principal is None:
                return _error(
                    401,
                    "Unauthorized",
                    "UNAUTHORIZED",
                    "a metrics token is needed (Authorization: Bearer <token>)",
                    'WWW-Authenticate: Bearer realm="detour"',
                ), False
            if not principal.may("GET", PATH):
                return _error(
                    403, "Forbidden", "FORBIDDEN", f"role {principal.role} may not scrape"
                ), False
            namespaces = principal.scrape_namespaces()
        body = await self._exposition.text(self._stores, namespaces)
        return _response(
            200, "OK", body, CONTENT_TYPE_LATEST, request.keep_alive
        ), request.keep_alive


async def open_metrics_listener(
    settings: Settings,
    tokens: TokenTable,
    exposition: Exposition,
    stores: Mapping[str, FaultStore],
) -> MetricsListener | None:
    """The listener on ``metrics_host:metrics_port`` when one is configured, else None.

    ``tokens``: the main listener's (used when ``metrics_tokens_file`` is not set)."""
    if settings.metrics_host is None:
        return None
    listener = MetricsListener(
        exposition, stores, metrics_tokens(settings, tokens), settings.header_timeout_s
    )
    await listener.start(settings.metrics_host, settings.metrics_port)
    log.info("metrics listener on %s:%d (GET /metrics only)", settings.metrics_host, listener.port)
    return listener
