"""A misbehaving front for a real Detour: real loopback sockets, no mocked HTTP library.

``FaultyFront`` listens on a free 127.0.0.1 port in front of a live Detour process.
Each request it reads is offered to its ``behaviour``; when that returns None (or
there is none) the request goes to Detour and Detour's answer comes back, the event
stream included, so a client first learns routes and config from the real service.
When it returns a ``Reply``, the reply writes whatever it likes on the socket: a
trickle, a wrong shape, a 401, a redirect, an endless line.

``misbehave`` swaps the behaviour and closes every open connection, so the client's
next call (and its event stream) opens a new one and meets the new behaviour.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

#: No test waits on a socket longer than this (s): a stuck peer ends the thread.
SOCKET_TIMEOUT_S = 30.0
STREAM_PATH = "/fault-items/stream"
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    raw: bytes


@dataclass
class Written:
    """What a reply managed to write before it finished or the client hung up."""

    attempted: int
    sent: int = 0
    seconds: float = 0.0
    hung_up: bool = False
    #: the reply used the connection up (no next request on it)
    ends_connection: bool = False


Reply = Callable[[socket.socket], Written]
Behaviour = Callable[[Request], Reply | None]


def _read_request(conn: socket.socket, buf: bytearray) -> Request | None:
    """One request from ``conn`` (``buf`` keeps bytes read past it); None at EOF."""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        rest += chunk
    body, after = rest[:length], rest[length:]
    buf[:] = after
    return Request(method, target, headers, body, head + b"\r\n\r\n" + body)


@dataclass
class FaultyFront:
    upstream: str
    behaviour: Behaviour | None = None
    #: every request read, in order
    requests: list[Request] = field(default_factory=list)
    #: what each reply wrote, in order
    written: list[Written] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._up = _host_port(self.upstream)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="faulty-front", daemon=True)
        self._thread.start()

    def __enter__(self) -> FaultyFront:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def misbehave(self, behaviour: Behaviour | None) -> None:
        """Answer with ``behaviour`` from now on (None: relay to Detour again)."""
        with self._lock:
            self.behaviour = behaviour
            conns = list(self._conns)
        for conn in conns:
            _hang_up(conn)

    def paths(self, method: str | None = None) -> list[str]:
        with self._lock:
            return [r.path for r in self.requests if method is None or r.method == method]

    def close(self) -> None:
        self._closed = True
        _hang_up(self._listener)  # shutdown wakes the blocked accept; close alone does not
        self.misbehave(None)
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.settimeout(SOCKET_TIMEOUT_S)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = bytearray()
        try:
            while True:
                request = _read_request(conn, buf)
                if request is None:
                    return
                with self._lock:
                    self.requests.append(request)
                    behaviour = self.behaviour
                reply = behaviour(request) if behaviour is not None else None
                if reply is not None:
                    written = reply(conn)
                    with self._lock:
                        self.written.append(written)
                    if written.hung_up or written.ends_connection:
                        return
                elif request.path.startswith(STREAM_PATH):
                    self._pump(conn, request)
                    return
                else:
                    self._relay(conn, request)
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            _hang_up(conn)

    def _relay(self, conn: socket.socket, request: Request) -> None:
        up = http.client.HTTPConnection(*self._up, timeout=SOCKET_TIMEOUT_S)
        try:
            headers = {k: v for k, v in request.headers.items() if k not in HOP_BY_HOP}
            up.request(request.method, request.path, request.body, headers)
            resp = up.getresponse()
            body = resp.read()
            lines = [f"HTTP/1.1 {resp.status} {resp.reason}"]
            lines += [f"{k}: {v}" for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP]
            lines.append(f"content-length: {len(body)}")
            conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        finally:
            up.close()

    def _pump(self, conn: socket.socket, request: Request) -> None:
        """The event stream as it comes: bytes from Detour until either side hangs up."""
        up = socket.create_connection(self._up, timeout=SOCKET_TIMEOUT_S)
        with self._lock:
            self._conns.add(up)
        try:
            up.sendall(request.raw)
            while chunk := up.recv(65536):
                conn.sendall(chunk)
        finally:
            with self._lock:
                self._conns.discard(up)
            _hang_up(up)


def two_broker_topic(url: str, name: str, token: str | None = None) -> str:
    """Registers topic ``name`` on the Detour at ``url`` (directly, not through a front) with
    brokers ``<name>-a`` and ``<name>-b``, one queue each; returns ``name``."""
    body = {"brokers": [{"brokerName": f"{name}-{b}", "writeQueueNums": 1} for b in "ab"]}
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn = http.client.HTTPConnection(*_host_port(url), timeout=SOCKET_TIMEOUT_S)
    try:
        conn.request("PUT", f"/routes/{name}", json.dumps(body), headers)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200, f"PUT /routes/{name}: HTTP {resp.status}"
    finally:
        conn.close()
    return name


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _hang_up(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


# ------------------------------------------------------------------------------- replies
def response(status: int, body: bytes = b"", headers: dict[str, str] | None = None,
             length: int | None = None) -> bytes:
    """A raw HTTP/1.1 response; ``length`` overrides the declared Content-Length."""
    reason = http.client.responses.get(status, "Whatever")
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines.append(f"content-length: {len(body) if length is None else length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def answer(status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> Reply:
    """A complete answer, at once; the connection stays open for the next request."""
    data = response(status, body, headers)

    def reply(conn: socket.socket) -> Written:
        conn.sendall(data)
        return Written(len(data), len(data))

    return reply


def trickle(data: bytes, every_s: float, at_once: int = 0) -> Reply:
    """``data[:at_once]`` at once, then one byte every ``every_s`` until done or hung up on.

    The sleep is the misbehaviour itself (a slowloris server), not a synchronisation.
    """

    def reply(conn: socket.socket) -> Written:
        start = time.monotonic()
        written = Written(len(data))
        try:
            conn.sendall(data[:at_once])
            written.sent = at_once
            for i in range(at_once, len(data)):
                time.sleep(every_s)
                conn.sendall(data[i : i + 1])
                written.sent += 1
        except OSError:
            written.hung_up = True
        written.seconds = time.monotonic() - start
        return written

    return reply


def endless_line(total: int, prefix: bytes = b"data: ") -> Reply:
    """An event stream whose first line never ends: ``total`` bytes without a newline,
    as fast as the client reads, then the connection is closed."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    block = b"x" * 65536

    def reply(conn: socket.socket) -> Written:
        start = time.monotonic()
        written = Written(total)
        try:
            conn.sendall(head + prefix)
            while written.sent < total:
                n = min(len(block), total - written.sent)
                conn.sendall(block[:n])
                written.sent += n
        except OSError:
            written.hung_up = True
        written.seconds = time.monotonic() - start
        written.ends_connection = True
        return written

    return reply


def hang_up() -> Reply:
    """No answer at all: the connection is closed under the request."""

    def reply(conn: socket.socket) -> Written:
        return Written(0, hung_up=True, ends_connection=True)

    return reply
