"""The refusal fast path of the edge protocol: whole simple requests refused from the raw
bytes while shedding, everything else left to the parser.

A real uvicorn server in this process (a thread of its own) runs ``EdgeProtocol`` with
a real ``Shedder`` and a small app that answers 200; the test talks to it over raw
sockets on 127.0.0.1. The protocol is subclassed only to record what the fast path
took from each read, so each test can tell the fast path from the parser's.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from prometheus_client import REGISTRY

from service.edge.hosts import HostNames
from service.edge.protocol import EDGE_STATE, Edge, EdgeLimits, EdgeProtocol
from service.edge.shedding import Shedder
from tests.procs import free_port, wait_until

pytestmark = pytest.mark.integration

#: What the fast path consumed, per read that it answered: (bytes read, bytes left).
TAKEN: list[tuple[int, int]] = []
#: The length of the head the connection remembered after each such read.
KNOWN: list[int] = []


class RecordingProtocol(EdgeProtocol):
    def _refuse_fast(self, data: bytes, edge: Edge, shedder: Shedder) -> bytes:
        rest = super()._refuse_fast(data, edge, shedder)
        if len(rest) < len(data):
            TAKEN.append((len(data), len(rest)))
            KNOWN.append(len(self._known_head))
        return rest


class Served:
    def __init__(self, shedder: Shedder, port: int) -> None:
        self.shedder = shedder
        self.port = port
        self.entered = 0

    def shed(self) -> None:
        """Every request refused from now on, and the service shedding for an hour."""
        self.shedder.max_in_flight = 0
        self.shedder.shedding_until = time.monotonic_ns() + 3600 * 10**9

    def admit(self) -> None:
        """Every request admitted (still shedding: the fast path asks the shedder)."""
        self.shedder.max_in_flight = 10_000


@pytest.fixture()
def served() -> Iterator[Served]:
    shedder = Shedder(None, max_in_flight=10_000, max_queue_wait_ms=60_000)
    edge = Edge(EdgeLimits(max_header_bytes=1024, max_headers=10, header_timeout_s=5,
                           hosts=HostNames.parse(None, "127.0.0.1")), shedder)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    scope["state"][EDGE_STATE] = edge
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        served.entered += 1
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    shedder.wrap(app)
    port = free_port()
    config = uvicorn.Config(shedder, host="127.0.0.1", port=port, http=RecordingProtocol,
                            loop="asyncio", log_level="warning", lifespan="on",
                            timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    served = Served(shedder, port)
    wait_until(lambda: server.started, 20, "the server started")
    TAKEN.clear()
    try:
        yield served
    finally:
        server.should_exit = True
        thread.join(20)


def request(path: bytes = b"/select", body: bytes = b"{}", extra: bytes = b"",
            version: bytes = b"HTTP/1.1") -> bytes:
    return (b"POST %s %s\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n%s"
            b"content-length: %d\r\n\r\n%s" % (path, version, extra, len(body), body))


def statuses(sock: socket.socket, n: int) -> list[int]:
    """The status codes of the next ``n`` responses (bounded by the socket's timeout)."""
    buf, out = b"", []
    while len(out) < n:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = buf[:end].decode("latin-1").lower()
            length = int(head.split("content-length:")[1].split("\r\n")[0])
            if len(buf) >= end + 4 + length:
                out.append(int(head.split(" ")[1]))
                buf = buf[end + 4 + length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {out}"
        buf += chunk
    return out


def shed_count(reason: str) -> float:
    value = REGISTRY.get_sample_value("detour_requests_shed_total", {"reason": reason})
    return value or 0.0


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def test_pipelined_requests_are_refused_in_one_read(served: Served) -> None:
    served.shed()
    with connect(served.port) as s:
        s.sendall(request() * 20)
        assert statuses(s, 20) == [503] * 20
        # The same connection keeps working once the service stops refusing.
        served.admit()
        s.sendall(request(body=b'{"a":1}'))
        assert statuses(s, 1) == [200]
    assert sum(n - left for n, left in TAKEN) == 20 * len(request())
    assert served.entered == 1


def test_a_partial_request_is_left_to_the_parser(served: Served) -> None:
    served.shed()
    whole = request(body=b'{"topic":"t"}')
    with connect(served.port) as s:
        s.sendall(whole + whole[:-5])  # the second body still arriving
        # The parser refuses the second once its head is read, before its body.
        assert statuses(s, 2) == [503, 503]
        served.admit()
        s.sendall(whole[-5:] + request(body=b'{"k":1}'))
        assert statuses(s, 1) == [200]  # the body's rest was dropped, the next one served
    # The fast path took exactly the whole first request from the first read.
    assert TAKEN and TAKEN[0][0] - TAKEN[0][1] == len(whole)
    assert served.entered == 1


def test_bodies_are_skipped_whole_and_the_next_request_is_read(served: Served) -> None:
    served.shed()
    big = request(body=b'{"x":"' + b"y" * 5000 + b'"}')
    with connect(served.port) as s:
        s.sendall(big + request())
        assert statuses(s, 2) == [503, 503]
        served.admit()
        s.sendall(request(body=b'{"after":1}'))
        assert statuses(s, 1) == [200]
    assert served.entered == 1


@pytest.mark.parametrize("path", [b"/healthz", b"/readyz", b"/metrics"])
def test_exempt_paths_go_to_the_app_while_shedding(served: Served, path: bytes) -> None:
    served.shed()
    with connect(served.port) as s:
        s.sendall(request(path=path) + request())
        assert statuses(s, 2) == [200, 503]
    assert served.entered == 1


def test_connection_close_falls_back_to_the_parser_and_closes(served: Served) -> None:
    served.shed()
    with connect(served.port) as s:
        s.sendall(request(extra=b"connection: close\r\n"))
        assert statuses(s, 1) == [503]
        assert s.recv(100) == b""  # closed after the refusal
    assert TAKEN == []


def test_http_1_0_falls_back_to_the_parser(served: Served) -> None:
    served.shed()
    with connect(served.port) as s:
        s.sendall(request(version=b"HTTP/1.0"))
        assert statuses(s, 1) == [503]
    assert TAKEN == []


def test_chunked_bodies_fall_back_to_the_parser(served: Served) -> None:
    served.shed()
    chunked = (b"POST /select HTTP/1.1\r\nhost: 127.0.0.1\r\ntransfer-encoding: chunked\r\n\r\n"
               b"2\r\n{}\r\n0\r\n\r\n")
    with connect(served.port) as s:
        s.sendall(chunked + request())
        assert statuses(s, 2) == [503, 503]
    assert TAKEN == []


def test_an_admitted_request_is_parsed_and_served_once(served: Served) -> None:
    """Shedding, but the shedder admits: the fast path hands the request to the parser,
    which does not ask the shedder a second time (one start counted, not two)."""
    served.shed()
    served.admit()
    with connect(served.port) as s:
        s.sendall(request(body=b'{"n":1}') + request(body=b'{"n":2}'))
        assert statuses(s, 2) == [200, 200]
    assert served.entered == 2 and TAKEN == []


def test_a_head_over_the_bound_is_never_taken_by_the_fast_path(served: Served) -> None:
    served.shed()
    with connect(served.port) as s:
        s.sendall(request(extra=b"x-pad: " + b"p" * 2000 + b"\r\n"))
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 431")
    assert TAKEN == []


def test_more_headers_than_the_bound_are_left_to_the_parser(served: Served) -> None:
    served.shed()
    many = b"".join(b"x-%d: 1\r\n" % i for i in range(12))
    with connect(served.port) as s:
        s.sendall(request(extra=many))
        assert s.recv(65536).startswith(b"HTTP/1.1 431")
    assert TAKEN == []


@contextlib.contextmanager
def refusing_server(timeout_keep_alive: int) -> Iterator[int]:
    """A server that refuses everything on the fast path; its port."""
    shedder = Shedder(None, max_in_flight=0, max_queue_wait_ms=60_000, shedding_hold_s=3600)
    # Connections the fast path refuses never prove themselves: their idle timeout is
    # uvicorn's keep-alive here, as these tests are about its timer.
    edge = Edge(EdgeLimits(header_timeout_s=30, unproven_idle_s=30), shedder)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    scope["state"][EDGE_STATE] = edge
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    shedder.wrap(app)
    shedder.shedding_until = time.monotonic_ns() + 3600 * 10**9
    port = free_port()
    config = uvicorn.Config(shedder, host="127.0.0.1", port=port, http=RecordingProtocol,
                            loop="asyncio", log_level="warning",
                            timeout_keep_alive=timeout_keep_alive)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 20, "the server started")
        TAKEN.clear()
        yield port
    finally:
        server.should_exit = True
        thread.join(20)


def test_the_keep_alive_timeout_applies_after_fast_refusals() -> None:
    """A connection idle after fast refusals is closed by uvicorn's keep-alive timeout
    (armed once per read), not held open."""
    with refusing_server(timeout_keep_alive=1) as port, connect(port) as s:
        s.sendall(request() * 3)
        assert statuses(s, 3) == [503] * 3
        start = time.monotonic()
        s.settimeout(15)
        assert s.recv(100) == b""
        assert 0.5 < time.monotonic() - start < 10
    assert TAKEN


def test_the_keep_alive_timeout_counts_from_the_last_refusal() -> None:
    """The fast path moves the running keep-alive timer rather than replacing it: a
    connection refused again shortly before the timer was due stays open for the whole
    timeout from that refusal, however many times it is moved."""
    with refusing_server(timeout_keep_alive=2) as port, connect(port) as s:
        s.settimeout(15)
        for _ in range(3):
            s.sendall(request())
            assert statuses(s, 1) == [503]
            # Time passing is the point here: most of the timeout, not all of it.
            time.sleep(1.2)
        s.sendall(request())
        assert statuses(s, 1) == [503]
        last = time.monotonic()
        assert s.recv(100) == b""  # closed, once idle for the whole timeout
        assert time.monotonic() - last > 1.8
    assert len(TAKEN) == 4


def test_a_long_head_is_refused_but_not_remembered() -> None:
    """Only heads up to 1 KiB are remembered: a connection's memory stays within the head
    bound's, whatever its heads."""
    long_head = request(extra=b"x-pad: " + b"p" * 2000 + b"\r\n")
    with refusing_server(timeout_keep_alive=30) as port, connect(port) as s:
        KNOWN.clear()
        s.sendall(long_head)
        assert statuses(s, 1) == [503]
        s.sendall(long_head)
        assert statuses(s, 1) == [503]
        s.sendall(request())
        assert statuses(s, 1) == [503]
    assert len(TAKEN) == 3
    assert KNOWN == [0, 0, len(request()) - 2]  # the short one is, its body of 2 aside


def test_a_repeated_head_is_refused_and_a_changed_one_judged_afresh(served: Served) -> None:
    """The fast path remembers a connection's last simple head: the same head again is
    refused without a scan, while a head that differs in any byte is judged anew (a new
    length, an exempt path, a header that makes it not simple)."""
    served.shed()
    with connect(served.port) as s:
        s.sendall(request(body=b'{"n":1}'))
        s.sendall(request(body=b'{"n":2}'))  # the same head, another body
        s.sendall(request(body=b'{"n":333}') + request(body=b'{"n":4}'))
        assert statuses(s, 4) == [503] * 4
        s.sendall(request(path=b"/healthz"))  # exempt: to the app
        assert statuses(s, 1) == [200]
        s.sendall(request(body=b'{"n":5}'))
        assert statuses(s, 1) == [503]
        s.sendall(request(body=b'{"n":6}', extra=b"connection: close\r\n"))
        assert statuses(s, 1) == [503]
        assert s.recv(100) == b""  # not simple: the parser refused it and closed
    # Every refusal but the last went the fast way, their bytes whole.
    taken = sum(n - left for n, left in TAKEN)
    assert taken == 4 * len(request(body=b'{"n":1}')) + len(request(body=b'{"n":333}'))
    assert served.entered == 1


def test_the_refusals_are_counted_by_reason(served: Served) -> None:
    served.shed()
    before = shed_count("in_flight")
    with connect(served.port) as s:
        s.sendall(request() * 5)
        assert statuses(s, 5) == [503] * 5
    assert shed_count("in_flight") - before == 5


@pytest.mark.parametrize(("raw", "status", "code"), [
    (b"FOO /select HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n", 400, "BAD_REQUEST"),
    (b"POST /sel\x01ect HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 0\r\n\r\n", 400,
     "BAD_REQUEST"),
    (b"POST /select HTTP/1.1\r\nhost: 127.0.0.1\r\nx: a\x01b\r\ncontent-length: 0\r\n\r\n",
     400, "BAD_REQUEST"),
    (b"POST /select HTTP/1.1\r\nhost: rebind.example\r\ncontent-length: 0\r\n\r\n", 421,
     "HOST_NOT_ALLOWED"),
    (b"GET /routes HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
     b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
     400, "BAD_REQUEST"),
    (b"POST /select HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: upgrade, http2-settings\r\n"
     b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAoAAAAAIAAAAA\r\ncontent-length: 2\r\n\r\n{}",
     400, "BAD_REQUEST"),
    (b"POST /select HTTP/2.0\r\nhost: 127.0.0.1\r\ncontent-length: 0\r\n\r\n", 400,
     "BAD_REQUEST"),
    (b"POST /select HTTP/1.1\r\nhost: 127.0.0.1\r\nhost: rebind.example\r\n"
     b"content-length: 0\r\n\r\n", 400, "BAD_REQUEST"),
    (b"POST /select HTTP/1.1\r\ncontent-length: 0\r\n\r\n", 400, "BAD_REQUEST"),
    (b"POST /select HTTP/1.1\r\nhost: a b\r\ncontent-length: 0\r\n\r\n", 400, "BAD_REQUEST"),
], ids=["unknown method", "control character in the target", "control character in a header",
        "foreign Host", "WebSocket upgrade", "h2c upgrade", "HTTP/2.0 as text",
        "two Hosts", "no Host", "a Host that is not host[:port]"])  # fmt: skip
def test_while_shedding_what_the_edge_refuses_is_refused_as_always(
    served: Served, raw: bytes, status: int, code: str
) -> None:
    """The fast path takes nothing the parser or the edge's checks would refuse: while
    shedding, a malformed request is still 400 and a foreign Host 421, in the Error
    shape, and the connection is closed (not 503 with the connection kept)."""
    served.shed()
    with connect(served.port) as s:
        s.sendall(raw)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert set(body) == {"error", "message", "field"} and body["error"] == code
    assert TAKEN == []
    assert served.entered == 0


def test_while_shedding_a_refused_request_whose_body_is_malformed_gets_one_answer(
    served: Served,
) -> None:
    """A request refused at its head (503) whose chunked body then fails to parse: its one
    answer is the 503, and the connection closes; a 400 after it would be paired by a
    pipelining client with its next request."""
    served.shed()
    raw = (b"POST /select HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
           b"transfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")  # fmt: skip
    with connect(served.port) as s:
        s.sendall(raw)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.count(b"HTTP/1.1 ") == 1, answer
    assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
    assert served.entered == 0
