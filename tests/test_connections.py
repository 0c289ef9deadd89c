"""Open connections, fairly (service/edge/connections.py), on a live server.

A client that opens connections up to the process's cap and holds them must not lock
anyone else out: at the cap, an idle connection makes room (one that has not proven
itself first), one peer holds at most its own cap, and connections that have not
proven themselves are closed after a short idle time. Each test starts
``python -m service`` and talks to it over raw sockets; the clients that play other
peers bind other loopback addresses (127.0.0.2, ...: the whole 127/8 is loopback), and
every connection goes to 127.0.0.1.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import ServiceProcess, write_tokens

pytestmark = [pytest.mark.e2e]

HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"


def connect(port: int, source: str = "127.0.0.1", timeout: float = 10) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                    source_address=(source, 0))


def is_closed(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server closed ``sock`` within ``wait_s`` (what it sent is read and dropped)."""
    sock.settimeout(wait_s)
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def still_open(sock: socket.socket) -> bool:
    """Open now: no end of stream waiting (looked at without blocking)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except (ConnectionResetError, BrokenPipeError):
        return False
    finally:
        sock.setblocking(True)


def answer(sock: socket.socket) -> bytes:
    """One whole answer (head and Content-Length body), bounded by the socket's timeout."""
    buf = b""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = buf[:end].decode("latin-1").lower()
            length = int(head.split("content-length:")[1].split("\r\n")[0])
            if len(buf) >= end + 4 + length:
                return buf[: end + 4 + length]
        chunk = sock.recv(65536)
        if not chunk:
            return buf
        buf += chunk


def served(sock: socket.socket) -> bool:
    """One request on ``sock`` answered 200 (keep-alive)."""
    sock.settimeout(10)
    sock.sendall(HEALTHZ)
    return answer(sock).startswith(b"HTTP/1.1 200 ")


def metric(url: str, sample: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def test_at_the_cap_a_new_client_is_served_by_closing_an_idle_connection() -> None:
    """One peer holds every connection the process may have, sending nothing; another
    client's new connections are still served, each closing one of those idle ones."""
    env = {"DETOUR_MAX_CONNECTIONS": "20", "DETOUR_UNPROVEN_IDLE_S": "60",
           "DETOUR_HEADER_TIMEOUT_S": "60"}
    with ServiceProcess(env=env) as proc:
        # Accepted in the order they connect (the listener's queue is first in, first
        # out): every one of these is open before the client's first connection.
        hog = [connect(proc.port, "127.0.0.2") for _ in range(20)]
        mine: list[socket.socket] = []
        try:
            for i in range(10):  # ten new connections, each kept open
                mine.append(connect(proc.port))
                assert served(mine[-1]), f"client connection {i} was not served"
            closed = sum(is_closed(s, 0.2) for s in hog)
            assert closed == 10, closed
            assert all(served(s) for s in mine)
        finally:
            for s in hog + mine:
                s.close()
        assert metric(proc.url, 'detour_edge_refused_total{reason="idle_evicted"}') >= 10


def test_connections_that_have_not_proven_themselves_make_room_first() -> None:
    """At the cap, of the idle connections those that never had a request served go first:
    a client's idle keep-alive connection stays while a silent one is closed for a new one."""
    env = {"DETOUR_MAX_CONNECTIONS": "4", "DETOUR_UNPROVEN_IDLE_S": "60",
           "DETOUR_HEADER_TIMEOUT_S": "60"}
    with ServiceProcess(env=env) as proc:
        kept = [connect(proc.port) for _ in range(2)]
        for s in kept:
            assert served(s)  # proven, then idle
        silent = [connect(proc.port, "127.0.0.2") for _ in range(2)]
        new: list[socket.socket] = []
        try:
            for _ in range(2):
                new.append(connect(proc.port, "127.0.0.3"))
                assert served(new[-1])
            assert all(is_closed(s, 2) for s in silent)
            assert all(still_open(s) for s in kept)
            assert all(served(s) for s in kept)
        finally:
            for s in kept + silent + new:
                s.close()


def test_busy_connections_are_not_closed_and_a_new_one_is_told_why() -> None:
    """At the cap with every connection busy (push streams being answered, as many as
    the cap allows them, half of it; requests whose bodies are arriving), a new connection
    is answered 503 SYSTEM_BUSY in the Error shape and closed; the busy ones go on."""
    env = {"DETOUR_MAX_CONNECTIONS": "5", "DETOUR_BODY_TIMEOUT_S": "60"}
    with ServiceProcess(env=env) as proc:
        busy = [connect(proc.port) for _ in range(5)]
        try:
            for s in busy[:2]:
                s.sendall(b"GET /fault-items/stream HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
                s.settimeout(10)
                assert s.recv(65536).startswith(b"HTTP/1.1 200 ")  # answering, for ever
            for s in busy[2:]:
                # The app waits for the body once it asks for it: uvicorn's 100 Continue.
                s.sendall(b"PUT /routes/t HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
                          b"application/json\r\ncontent-length: 100\r\n"
                          b"expect: 100-continue\r\n\r\n")  # fmt: skip
                s.settimeout(10)
                assert s.recv(65536).startswith(b"HTTP/1.1 100 ")
                s.sendall(b"{")  # and the rest never comes
            with connect(proc.port, "127.0.0.2") as extra:
                extra.settimeout(10)
                refusal = answer(extra)
            assert refusal.startswith(b"HTTP/1.1 503 "), refusal[:200]
            body = json.loads(refusal.split(b"\r\n\r\n", 1)[1])
            assert body["error"] == "SYSTEM_BUSY" and set(body) == {"error", "message", "field"}
            assert all(still_open(s) for s in busy)
        finally:
            for s in busy:
                s.close()


def test_one_peer_holds_at_most_its_cap() -> None:
    """Past its cap a peer's new connection is refused, under the process's cap; another
    peer is served."""
    env = {"DETOUR_MAX_CONNECTIONS_PER_PEER": "5", "DETOUR_UNPROVEN_IDLE_S": "60",
           "DETOUR_HEADER_TIMEOUT_S": "60"}
    with ServiceProcess(env=env) as proc:
        held = [connect(proc.port, "127.0.0.2") for _ in range(5)]
        try:
            extra = [connect(proc.port, "127.0.0.2") for _ in range(3)]
            for s in extra:
                s.settimeout(10)
                assert answer(s).startswith(b"HTTP/1.1 503 ")
                assert is_closed(s, 5)
                s.close()
            assert all(still_open(s) for s in held)
            with connect(proc.port) as other:
                assert served(other)
        finally:
            for s in held:
                s.close()
        assert metric(proc.url, 'detour_edge_refused_total{reason="peer_connections"}') == 3


def test_without_a_valid_token_a_connection_idles_briefly(tmp_path: Path) -> None:
    """With tokens, a connection that showed no valid token is closed after the short idle
    timeout, whether it sent nothing or was refused 401; one that showed a valid token
    keeps the keep-alive timeout."""
    tokens = write_tokens(tmp_path / "tokens.json",
                          {"p": ("token-p-0123456789", "producer", "default")})
    env = {"DETOUR_TOKENS_FILE": str(tokens), "DETOUR_UNPROVEN_IDLE_S": "0.5"}
    with ServiceProcess(env=env) as proc:
        silent = connect(proc.port)
        refused = connect(proc.port)
        proven = connect(proc.port)
        try:
            refused.sendall(b"GET /config HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            refused.settimeout(10)
            assert answer(refused).startswith(b"HTTP/1.1 401 ")
            proven.sendall(b"GET /config HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                           b"authorization: Bearer token-p-0123456789\r\n\r\n")
            proven.settimeout(10)
            assert answer(proven).startswith(b"HTTP/1.1 200 ")
            start = time.monotonic()
            assert is_closed(silent, 5) and is_closed(refused, 5)
            assert time.monotonic() - start < 3
            # uvicorn's keep-alive timeout is 5 s: well past the short one, still open.
            time.sleep(1.5)
            assert still_open(proven)
        finally:
            for s in (silent, refused, proven):
                s.close()


def test_at_the_cap_connections_holding_requests_without_a_token_make_room(
    tmp_path: Path,
) -> None:
    """With tokens, a client without one fills every connection with a request whose body
    never comes (a head, then one byte: answered 401, or still being read). Each hold is
    bounded by the body deadline, but reconnecting it held the process for as long as it
    liked: a producer with a valid token was refused 503. Now, with none idle, the
    unproven connection reading the longest makes room, and the producer is served."""
    token, admin = "token-p-0123456789", "token-a-0123456789"
    tokens = write_tokens(tmp_path / "tokens.json", {"p": (token, "producer", "default"),
                                                     "a": (admin, "admin", "default")})
    env = {"DETOUR_TOKENS_FILE": str(tokens), "DETOUR_MAX_CONNECTIONS": "8",
           "DETOUR_MAX_CONNECTIONS_PER_PEER": "8", "DETOUR_BODY_TIMEOUT_S": "60",
           "DETOUR_HEADER_TIMEOUT_S": "60"}  # fmt: skip
    with ServiceProcess(env=env) as proc:
        holders = [connect(proc.port, "127.0.0.2") for _ in range(8)]
        try:
            for i, s in enumerate(holders):
                if i % 2:  # a head never finished
                    s.sendall(b"PUT /config HTTP/1.1\r\nhost: 127.0.0.1\r\n")
                else:  # a whole head (refused 401), then a body that never comes
                    s.sendall(b"PUT /config HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
                              b"application/json\r\ncontent-length: 100\r\n\r\n{")  # fmt: skip
            for s in holders[::2]:
                s.settimeout(10)
                assert answer(s).startswith(b"HTTP/1.1 401 ")
            with connect(proc.port, "127.0.0.3") as producer:
                producer.settimeout(10)
                producer.sendall(b"GET /config HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                                 b"authorization: Bearer " + token.encode() + b"\r\n\r\n")
                assert answer(producer).startswith(b"HTTP/1.1 200 ")
            assert sum(is_closed(s, 0.5) for s in holders) == 1  # the oldest holder
            scrape = httpx.get(proc.url + "/metrics", timeout=10,
                               headers={"authorization": f"Bearer {admin}"}).text
            assert 'detour_edge_refused_total{reason="reading_evicted"} 1.0' in scrape
        finally:
            for s in holders:
                s.close()
