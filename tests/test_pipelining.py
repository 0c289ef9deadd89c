"""The pipelining bound (service/edge/pipelining.py) on a live server, on both ways in.

A client that pipelines requests and never reads its answers must not grow the server:
the edge parses only a few requests ahead of the answers its client has taken, holds at
most one read, and stops reading the socket. A client that does read gets every answer,
in order, however many it pipelines. Each test starts ``python -m service`` and talks to
it over raw sockets on 127.0.0.1; the ASGI way is ``GET /healthz`` (and a token guard's
401), the direct lane ``POST /select``.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.procs import ServiceProcess, write_tokens

pytestmark = [pytest.mark.e2e]

ROUTE = {"brokers": [{"brokerName": "broker-a", "writeQueueNums": 2}]}
SELECT = json.dumps({"topic": "orders"}).encode()
REQUESTS = {
    "asgi": b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n",
    "direct": b"POST /select HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(SELECT), SELECT),
}
TOKEN = "token-p-0123456789"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[ServiceProcess]:
    """A fresh service per test: a process's RSS does not shrink back after a test that
    grew it, and each test measures its own growth."""
    tokens = write_tokens(tmp_path / "tokens.json", {"p": (TOKEN, "admin", "default")})
    # 2,000 selects in one write are more than the shedder lets one loop turn start (the
    # in-flight bound counts what a turn started): this module is about pipelining.
    env = {"DETOUR_TOKENS_FILE": str(tokens), "DETOUR_MAX_IN_FLIGHT": "100000"}
    with ServiceProcess(env=env) as proc:
        httpx.put(proc.url + "/routes/orders", json=ROUTE, timeout=10,
                  headers={"authorization": f"Bearer {TOKEN}"}).raise_for_status()
        yield proc


def with_token(request: bytes) -> bytes:
    return request.replace(b"host: 127.0.0.1\r\n",
                           b"host: 127.0.0.1\r\nauthorization: Bearer %s\r\n" % TOKEN.encode())


def pipeline_without_reading(port: int, request: bytes, seconds: float) -> int:
    """Send ``request`` again and again on one connection with a 4 KiB receive buffer, for
    ``seconds``, never reading an answer; the bytes the server took."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    burst = request * 256
    sent = 0
    ends = time.monotonic() + seconds
    try:
        while time.monotonic() < ends:
            try:
                sent += sock.send(burst)
            except BlockingIOError:
                time.sleep(0.01)  # the server stopped reading: that is the point
            except (BrokenPipeError, ConnectionResetError):
                break
    finally:
        sock.close()
    return sent


@pytest.mark.parametrize(("lane", "request_bytes"), [
    ("asgi", with_token(REQUESTS["asgi"])),
    ("direct", with_token(REQUESTS["direct"])),
    ("guard's 401", b"GET /config HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"),
])  # fmt: skip
def test_a_pipeliner_that_never_reads_does_not_grow_the_server(
    svc: ServiceProcess, lane: str, request_bytes: bytes
) -> None:
    before = rss_kib(svc.proc.pid)
    sent = pipeline_without_reading(svc.port, request_bytes, seconds=3)
    grown_mib = (rss_kib(svc.proc.pid) - before) / 1024
    print(f"{lane}: server took {sent / 2**20:.1f} MiB of requests, RSS grew {grown_mib:.1f} MiB")
    assert grown_mib < 32, f"{lane}: RSS grew by {grown_mib:.1f} MiB"
    # The server stopped reading: far less was taken than three seconds of loopback carry.
    # (The direct lane was bounded before the pipelining bound too: its answers filled
    # the transport, which sent later requests the ASGI way, queued with reading paused.
    # It is tested all the same, as the bound holds for both ways in.)
    assert sent < 64 * 2**20, sent
    assert httpx.get(svc.url + "/healthz", timeout=10).status_code == 200


def read_answers(sock: socket.socket, n: int) -> list[int]:
    """The statuses of the next ``n`` answers, in order (bounded by the socket's timeout)."""
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
        assert chunk, f"connection closed after {len(out)} answers"
        buf += chunk
    return out


@pytest.mark.parametrize("lane", ["asgi", "direct"])
def test_a_pipeliner_that_reads_gets_every_answer_in_order(svc: ServiceProcess, lane: str) -> None:
    """2,000 requests in one write: the server reads them a few at a time as the answers
    drain, and answers each."""
    request = with_token(REQUESTS[lane])
    with socket.create_connection(("127.0.0.1", svc.port), timeout=30) as s:
        s.sendall(request * 2000 + b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        statuses = read_answers(s, 2001)
    assert statuses == [200] * 2001


def endless_trailer(port: int, head: bytes, limit_bytes: int, seconds: float) -> int:
    """A chunked body, then one trailer field that never ends (up to ``limit_bytes`` or
    ``seconds``, within the body deadline); the bytes the server took before it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        body = b'{"brokerName": "trailed", "latencyMs": 5}'
        sock.sendall(head + b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\nx-trailer: "
                     % (len(body), body))  # fmt: skip
        sent = 0
        chunk = b"a" * 65536
        ends = time.monotonic() + seconds
        try:
            while sent < limit_bytes and time.monotonic() < ends:
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
    return sent


@pytest.mark.parametrize("who", ["with a token", "without one (the guard's 401)"])
def test_what_follows_a_head_is_bounded_trailers_included(
    svc: ServiceProcess, who: str
) -> None:
    """The parser holds a trailer's value whole: three connections each sending one that
    never ends were taking 150 MiB. What follows a head, chunk framing and trailers
    included, is bounded (twice the largest body limit plus the head bound): the
    connection is closed past it, and the server does not grow."""
    head = b"POST /report-latency HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    if who == "with a token":
        head = with_token(head)
    before = rss_kib(svc.proc.pid)
    taken = [endless_trailer(svc.port, head, 48 * 2**20, seconds=3) for _ in range(3)]
    grown_mib = (rss_kib(svc.proc.pid) - before) / 1024
    assert grown_mib < 32, f"RSS grew by {grown_mib:.1f} MiB"
    # The bound is 544 KiB; the kernel's buffers on both sides take a few MiB more.
    assert all(t < 16 * 2**20 for t in taken), taken
    with httpx.Client(base_url=svc.url, timeout=10,
                      headers={"authorization": f"Bearer {TOKEN}"}) as http:  # fmt: skip
        text = http.get("/metrics").text
        refused = next(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith('detour_edge_refused_total{reason="body_too_large"}'))
        assert refused == 3, refused
        assert http.get("/healthz").status_code == 200


def refused_count(url: str, reason: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10,
                     headers={"authorization": f"Bearer {TOKEN}"}).text
    line = f'detour_edge_refused_total{{reason="{reason}"}}'
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_a_connection_closed_with_its_answer_unread_is_reset(svc: ServiceProcess) -> None:
    """A client asks for a large answer and never reads it. At its idle deadline the
    connection is reset, not closed: a close leaves the unread bytes to the kernel, which
    keeps them for minutes (FIN-WAIT-1, the client's window shut) after the connection has
    left the connection table, about 1.7 MB for a /latency-log page, so closed connections
    held memory that no cap counted."""
    request = with_token(b"GET /openapi.json HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
    size = len(httpx.get(svc.url + "/openapi.json", timeout=10,
                         headers={"authorization": f"Bearer {TOKEN}"}).content)
    before = refused_count(svc.url, "unread_reset")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", svc.port))
        sock.sendall(request)
        # The idle deadline (uvicorn's keep-alive, 5 s) passes with the answer unread.
        deadline = time.monotonic() + 20
        while refused_count(svc.url, "unread_reset") == before:
            assert time.monotonic() < deadline, "the unread connection was never reset"
            time.sleep(0.2)  # polling another process's counter: there is no event to await
        sock.settimeout(10)
        got = 0
        with pytest.raises(ConnectionResetError):
            while chunk := sock.recv(65536):
                got += len(chunk)
            raise AssertionError(f"closed after the whole answer ({got} bytes), not reset")
    assert got < size, (got, size)


def kernel_queues(server_port: int, client_port: int) -> tuple[int, int] | None:
    """(send queue, receive queue) in bytes of the server's socket of one loopback
    connection, from /proc/net/tcp (what the kernel holds for it); None if not found."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queues = fields[1], fields[2], fields[4]
        if int(local.split(":")[1], 16) == server_port and \
                int(remote.split(":")[1], 16) == client_port:  # fmt: skip
            tx, rx = queues.split(":")
            return int(tx, 16), int(rx, 16)
    return None


def settled_queues(server_port: int, client_port: int) -> tuple[int, int]:
    """The server socket's queues once they stop moving (three equal readings 50 ms apart,
    at most 10 s): another process's kernel state, which no event announces."""
    last, same = None, 0
    deadline = time.monotonic() + 10
    while same < 3 and time.monotonic() < deadline:
        now = kernel_queues(server_port, client_port)
        assert now is not None, "the connection is not in /proc/net/tcp"
        same = same + 1 if now == last else 0
        last = now
        time.sleep(0.05)
    assert last is not None
    return last


#: What the kernel may hold per connection each way: ``socket_buffer_bytes`` (64 KiB),
#: doubled by Linux.
KERNEL_BOUND = 2 * 64 * 1024


def test_the_kernel_holds_little_of_the_answers_of_a_client_that_reads_none(
    svc: ServiceProcess,
) -> None:
    """A client asks for large answers and reads none. The kernel's send buffer was
    autotuned: on loopback it took a megabyte and more per connection, which no bound saw
    and cgroup v2 charges to the pod. Fixed, it holds at most twice the setting; the rest
    waits in the transport, where the pipelining bound stops reading more requests."""
    request = with_token(b"GET /openapi.json HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
    size = len(httpx.get(svc.url + "/openapi.json", timeout=10,
                         headers={"authorization": f"Bearer {TOKEN}"}).content)
    count = 4 * 2**20 // size + 1  # 4 MiB of answers asked for
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", svc.port))
        sock.sendall(request * count)
        sent, _ = settled_queues(svc.port, sock.getsockname()[1])
    assert sent <= KERNEL_BOUND, f"the kernel holds {sent} bytes of answers for one connection"
    assert httpx.get(svc.url + "/healthz", timeout=10).status_code == 200


def test_the_kernel_holds_little_of_what_a_flooding_client_sends(svc: ServiceProcess) -> None:
    """A client sends requests as fast as loopback takes them and reads no answer: the
    server stops reading (the pipelining bound), and what the kernel keeps for it is the
    receive buffer, fixed at twice the setting, not one grown while it was read quickly."""
    burst = with_token(REQUESTS["asgi"]) * 4096
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * 2**20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", svc.port))
        sock.setblocking(False)
        ends = time.monotonic() + 2
        while time.monotonic() < ends:
            try:
                sock.send(burst)
            except BlockingIOError:
                time.sleep(0.01)  # both buffers are full: the flood is as deep as it goes
        _, received = settled_queues(svc.port, sock.getsockname()[1])
    assert received <= KERNEL_BOUND, f"the kernel holds {received} bytes unread for one connection"
    assert httpx.get(svc.url + "/healthz", timeout=10).status_code == 200
