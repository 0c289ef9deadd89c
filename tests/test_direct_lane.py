"""The direct lane (service/edge/direct.py) against the ASGI path it stands in for.

Two real uvicorn servers in this process (threads of their own), each running Detour's
app and ``EdgeProtocol``: one with the direct lane, one without (``direct_lane=False``).
The same requests, as raw bytes over 127.0.0.1, go to both; the answers (status,
headers but the date, body) and the metrics they move must be the same. The protocol is
subclassed only to record which requests the lane answered and which it declined, so
that every case also proves which way it went.
"""

from __future__ import annotations

import json
import random
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import pytest
import uvicorn
from prometheus_client import REGISTRY

from service.app import create_app
from service.auth import Role, TokenEntry, TokenTable, hash_token
from service.edge.protocol import EdgeProtocol
from service.settings import Settings
from tests.procs import PATIENT_CALL_TIMEOUT_S, free_port, wait_until

pytestmark = pytest.mark.integration

ROUTE = {
    "brokers": [
        {"brokerName": "broker-a", "writeQueueNums": 2},
        {"brokerName": "broker-b", "writeQueueNums": 2},
        {"brokerName": "broker-c", "writeQueueNums": 2},
    ]
}
QUEUES = [(b, q) for b in ("broker-a", "broker-b", "broker-c") for q in range(2)]


@dataclass
class Server:
    kind: str
    port: int
    #: per port: the lane's verdicts, in order ("direct" or "declined")
    ways: list[str] = field(default_factory=list)
    uv: uvicorn.Server | None = None

    def idle(self) -> bool:
        """No request of this server is still running: the ASGI way records a request's
        metrics after its last byte is sent, so its answer can reach the client first (the
        lane records before it writes). uvicorn keeps each request's task in this set until
        the task is done."""
        assert self.uv is not None
        return not self.uv.server_state.tasks


WAYS: dict[int, list[str]] = {}


class RecordingProtocol(EdgeProtocol):
    def _answer_directly(self, path: bytes, body: bytes) -> None:
        before = self.cycle
        super()._answer_directly(path, body)
        way = "declined" if self.cycle is not before else "direct"
        WAYS.setdefault(self.server[1] if self.server else 0, []).append(way)


@contextmanager
def running(
    settings: Settings, tokens: TokenTable | None = None,
    protocol: type[EdgeProtocol] = RecordingProtocol,
) -> Iterator[tuple[int, uvicorn.Server]]:  # fmt: skip
    """Detour's app on a uvicorn server in a thread of its own: (port, server)."""
    port = free_port()
    config = uvicorn.Config(
        create_app(settings, tokens), host="127.0.0.1", port=port, http=protocol,
        log_level="warning", lifespan="on", access_log=False, server_header=False,
        timeout_graceful_shutdown=30,
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the server started")
    WAYS[port] = []
    try:
        yield port, server
    finally:
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive(), "the server stopped"


def _serve(settings: Settings, tokens: TokenTable | None = None) -> Iterator[Server]:
    with running(settings, tokens) as (port, uv):
        yield Server("redis" if settings.redis_url else "memory", port, WAYS[port], uv)


def _settings(store: str, redis_url: str | None, direct: bool) -> Settings:
    if store == "redis":
        return Settings(
            redis_url=redis_url, redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S, direct_lane=direct,
            namespace="direct" if direct else "asgi",
        )  # fmt: skip
    return Settings(direct_lane=direct)


@pytest.fixture(params=["memory", "redis"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Server, Server]]:
    """(with the lane, without), each with the test route; on Redis, one namespace each."""
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    lanes = _serve(_settings(request.param, url, True))
    plain = _serve(_settings(request.param, url, False))
    servers = (next(lanes), next(plain))
    try:
        for s in servers:
            status, _, _ = exchange(s.port, http("PUT", "/routes/orders", ROUTE))
            assert status == 200
            # broker-a's item exists: its fast reports change nothing others must see.
            first = {"brokerName": "broker-a", "latencyMs": 1}
            status, _, _ = exchange(s.port, http("POST", "/report-latency", first))
            assert status == 200
            s.ways.clear()
        yield servers
    finally:
        for gen in (lanes, plain):
            gen.close()


def http(
    method: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    headers: bytes = b"content-type: application/json\r\n",
    version: bytes = b"HTTP/1.1",
) -> bytes:
    data = raw if raw is not None else b"" if body is None else json.dumps(body).encode()
    return (b"%s %s %s\r\nhost: 127.0.0.1\r\n%scontent-length: %d\r\n\r\n%s"
            % (method.encode(), path.encode(), version, headers, len(data), data))  # fmt: skip


def read_answers(sock: socket.socket, n: int) -> list[tuple[int, dict[str, str], bytes]]:
    """The next ``n`` answers (bounded by the socket's timeout)."""
    buf, out = b"", []
    while len(out) < n:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            lines = buf[:end].decode("latin-1").split("\r\n")
            heads = dict(line.lower().split(": ", 1) for line in lines[1:])
            length = int(heads.get("content-length", "0"))
            if len(buf) >= end + 4 + length:
                out.append((int(lines[0].split(" ")[1]), heads, buf[end + 4 : end + 4 + length]))
                buf = buf[end + 4 + length :]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {len(out)} answers"
        buf += chunk
    return out


def exchange(port: int, *requests: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``requests`` pipelined on one connection; the last answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(b"".join(requests))
        return read_answers(s, len(requests))[-1]


#: Metrics the servers' own background work moves (flushes, syncs, store round trips).
_BACKGROUND = (
    "detour_report_flushes",
    "detour_store_",
    "detour_view_",
    "detour_detector_",
    "detour_journal_",
)


def samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every Detour counter and histogram count, by name and labels (not the namespace)."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in REGISTRY.collect():
        for s in family.samples:
            if not s.name.startswith("detour_") or s.name.endswith(("_sum", "_bucket", "_created")):
                continue
            if s.name.startswith(_BACKGROUND):
                continue
            if family.type not in ("counter", "histogram"):
                continue
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "namespace"))
            key = (s.name, labels)
            out[key] = out.get(key, 0.0) + s.value
    return out


def moved(before: dict[Any, float], after: dict[Any, float]) -> dict[Any, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def same_answer(a: tuple[int, dict[str, str], bytes], b: tuple[int, dict[str, str], bytes],
                mask: tuple[str, ...] = ()) -> None:  # fmt: skip
    assert a[0] == b[0], (a, b)
    ha = {k: v for k, v in a[1].items() if k != "date"}
    hb = {k: v for k, v in b[1].items() if k != "date"}
    if mask:  # masked fields change the body's length
        ha.pop("content-length", None)
        hb.pop("content-length", None)
    assert ha == hb
    if not mask:
        assert a[2] == b[2]
        return
    ja, jb = json.loads(a[2]), json.loads(b[2])
    for key in mask:
        ja.pop(key, None)
        jb.pop(key, None)
    assert ja == jb


def both(pair: tuple[Server, Server], request: bytes, mask: tuple[str, ...] = ()
         ) -> tuple[tuple[int, dict[str, str], bytes], dict[Any, float]]:  # fmt: skip
    """The request to each server: the same answer and the same metrics moved."""
    results = []
    def idle() -> None:  # the registry is shared: neither server may still be recording
        wait_until(lambda: all(s.idle() for s in pair), 10, "the servers finished",
                   interval_s=0.005)

    for server in pair:
        idle()
        before = samples()
        answer = exchange(server.port, request)
        idle()
        results.append((answer, moved(before, samples())))
    (a, ma), (b, mb) = results
    same_answer(a, b, mask)
    assert ma == mb
    return a, ma


#: Requests the lane answers itself, each with the answer's status.
ANSWERED = [
    ("select", http("POST", "/select", {"topic": "orders"}), 200),
    (
        "select retry",
        http("POST", "/select", {"topic": "orders", "lastBrokerName": "broker-a"}),
        200,
    ),
    (
        "inline queues",
        http("POST", "/select", {"topic": "t", "queues": [{"brokerName": "x", "queueId": 3}]}),
        200,
    ),
    ("sharding key", http("POST", "/select", {"topic": "orders", "shardingKey": "k1"}), 200),
    ("producer", http("POST", "/select", {"topic": "orders", "producer": "p-1"}), 200),
    ("query string", http("POST", "/select?x=1", {"topic": "orders"}), 200),
    (
        "charset",
        http(
            "POST",
            "/select",
            {"topic": "orders"},
            headers=b"content-type: application/json; charset=utf-8\r\n",
        ),
        200,
    ),
    ("unknown topic", http("POST", "/select", {"topic": "nope"}), 404),
    ("wrong type", http("POST", "/select", {"topic": 5}), 422),
    ("missing field", http("POST", "/select", {}), 422),
    ("bad name", http("POST", "/select", {"topic": "a b"}), 422),
    ("unknown field", http("POST", "/select", {"topic": "orders", "extra": 1}), 422),
    ("not JSON", http("POST", "/select", raw=b"{topic"), 422),
    ("JSON null", http("POST", "/select", raw=b"null"), 422),
    ("repeated key", http("POST", "/select", raw=b'{"topic":"orders","topic":"x"}'), 422),
    ("deep nesting", http("POST", "/select", raw=b"[" * 5000 + b"]" * 5000), 422),
    (
        "huge number",
        http("POST", "/report-latency", raw=b'{"brokerName":"b","latencyMs":' + b"9" * 5000 + b"}"),
        422,
    ),
    ("report", http("POST", "/report-latency", {"brokerName": "broker-a", "latencyMs": 7}), 200),
    (
        "report bad latency",
        http("POST", "/report-latency", {"brokerName": "broker-a", "latencyMs": -1}),
        422,
    ),
    ("report missing broker", http("POST", "/report-latency", {"latencyMs": 1}), 422),
]

#: Heads the lane does not take: they go the ASGI way from the start.
NOT_TAKEN = [
    ("no content type", http("POST", "/select", {"topic": "orders"}, headers=b""), 415),
    (
        "text body",
        http("POST", "/select", {"topic": "orders"}, headers=b"content-type: text/plain\r\n"),
        415,
    ),
    ("over the limit", http("POST", "/select", raw=b" " * 70_000), 413),
    ("empty body", http("POST", "/select", raw=b""), 422),
    ("HTTP/1.0", http("POST", "/select", {"topic": "orders"}, version=b"HTTP/1.0"), 200),
    ("GET", http("GET", "/select"), 405),
]


@pytest.mark.parametrize(
    ("name", "request_bytes", "status"), ANSWERED, ids=[c[0] for c in ANSWERED]
)
def test_the_lane_answers_as_the_asgi_path_does(
    pair: tuple[Server, Server], name: str, request_bytes: bytes, status: int
) -> None:
    lane = pair[0]
    mask = ("availableAt",) if b"/report-latency" in request_bytes[:40] else ()
    if name in ("select", "select retry", "sharding key", "producer", "query string", "charset"):
        mask += ("brokerName", "queueId")  # a random start per replica; order checked apart
    answer, metrics = both(pair, request_bytes, mask)
    assert answer[0] == status
    assert lane.ways == ["direct"], "the lane answered it, not the ASGI path"
    route = "/select" if b"/select" in request_bytes[:20] else "/report-latency"
    key = ("detour_http_request_duration_seconds_count",
           (("method", "POST"), ("route", route), ("status", str(status))))  # fmt: skip
    assert metrics.get(key) == 1.0, metrics


@pytest.mark.parametrize(
    ("name", "request_bytes", "status"), NOT_TAKEN, ids=[c[0] for c in NOT_TAKEN]
)
def test_heads_the_lane_does_not_take_go_the_asgi_way(
    pair: tuple[Server, Server], name: str, request_bytes: bytes, status: int
) -> None:
    answer, _ = both(pair, request_bytes, ("brokerName", "queueId") if status == 200 else ())
    assert answer[0] == status
    assert pair[0].ways == []


def _position(answer: tuple[int, dict[str, str], bytes]) -> int:
    body = json.loads(answer[2])
    return QUEUES.index((body["brokerName"], body["queueId"]))


def test_round_robin_and_avoidance_follow_the_same_walk(pair: tuple[Server, Server]) -> None:
    """A sequence of selects and reports: the same queues, decisions and avoided brokers."""
    steps = [http("POST", "/select", {"topic": "orders"})] * 4 + [
        http("POST", "/report-latency", {"brokerName": "broker-b", "latencyMs": 5000}),
        *[http("POST", "/select", {"topic": "orders"})] * 6,
        http("POST", "/report-latency", {"brokerName": "broker-c", "isolation": True,
                                          "latencyMs": 1}),
        *[http("POST", "/select", {"topic": "orders", "lastBrokerName": "broker-a"})] * 3,
    ]  # fmt: skip
    walks = []
    for server in pair:
        with socket.create_connection(("127.0.0.1", server.port), timeout=15) as s:
            answers = []
            for i, step in enumerate(steps):
                if i == 0:
                    # The topic's counter starts at random on each replica: the same
                    # start for both (nothing else draws before it, avoidance on and
                    # round robin the selection).
                    random.seed(17)
                s.sendall(step)
                answers.append(read_answers(s, 1)[0])
        selects = [a for a, st in zip(answers, steps, strict=True) if b"/select" in st[:20]]
        walks.append([
            (_position(a), json.loads(a[2])["decision"], json.loads(a[2])["avoidedBrokers"])
            for a in selects
        ])  # fmt: skip
        assert [a[0] for a in answers] == [200] * len(steps)
    assert walks[0] == walks[1], walks
    assert any(avoided for _, _, avoided in walks[0]), "the reports opened windows"


def test_pipelined_requests_are_answered_in_order(pair: tuple[Server, Server]) -> None:
    """Direct answers, a refusal of the ASGI path and direct answers again, in one read:
    every answer in its request's order, on one connection."""
    lane = pair[0]
    reqs = [
        http("POST", "/select", {"topic": "orders"}),
        http("POST", "/select", {"topic": "nope"}),
        http("POST", "/select", {"topic": "orders"}, headers=b""),  # 415, the ASGI way
        http("GET", "/healthz", headers=b""),
        http("POST", "/report-latency", {"brokerName": "broker-a", "latencyMs": 3}),
        http("POST", "/select", raw=b"{"),
    ]
    with socket.create_connection(("127.0.0.1", lane.port), timeout=15) as s:
        s.sendall(b"".join(reqs))
        answers = read_answers(s, len(reqs))
    assert [a[0] for a in answers] == [200, 404, 415, 200, 200, 422]
    assert json.loads(answers[4][2])["brokerName"] == "broker-a"
    # The two before the 415 directly; the rest queued behind its cycle, as uvicorn
    # queues pipelined requests, and answered the ASGI way in order.
    assert lane.ways == ["direct", "direct"]


def test_connection_close_is_honoured(pair: tuple[Server, Server]) -> None:
    lane = pair[0]
    with socket.create_connection(("127.0.0.1", lane.port), timeout=15) as s:
        s.sendall(
            http(
                "POST",
                "/select",
                {"topic": "orders"},
                headers=b"content-type: application/json\r\nconnection: close\r\n",
            )
        )
        ((status, heads, _),) = read_answers(s, 1)
        assert (status, heads.get("connection")) == (200, "close")
        assert s.recv(1) == b"", "the server closed the connection"
    assert lane.ways == ["direct"]


def test_a_body_in_pieces_is_answered_once_whole(pair: tuple[Server, Server]) -> None:
    lane = pair[0]
    request = http("POST", "/select", {"topic": "orders"})
    head_end = request.index(b"\r\n\r\n") + 4
    with socket.create_connection(("127.0.0.1", lane.port), timeout=15) as s:
        s.sendall(request[: head_end + 3])
        # Nothing is answered before the body is whole: the next bytes complete it.
        s.settimeout(0.2)
        with pytest.raises(TimeoutError):
            s.recv(1)
        s.settimeout(15)
        s.sendall(request[head_end + 3 :])
        ((status, _, _),) = read_answers(s, 1)
    assert status == 200
    assert lane.ways == ["direct"]


def test_a_report_the_store_must_write_is_answered_the_asgi_way(
    pair: tuple[Server, Server],
) -> None:
    """On Redis a report that opens a window waits for the script: the lane declines it
    before changing anything, and the ASGI path answers it (on memory it never waits)."""
    lane = pair[0]
    slow = http("POST", "/report-latency", {"brokerName": "broker-b", "latencyMs": 5000})
    answer, metrics = both(pair, slow, ("availableAt",))
    assert answer[0] == 200
    assert json.loads(answer[2])["notAvailableDurationMs"] == 180_000
    assert lane.ways == ["declined" if lane.kind == "redis" else "direct"]
    opened = ("detour_window_events_total", (("kind", "opened"), ("reason", "latency")))
    assert metrics.get(opened) == 1.0, metrics


TOKENS = {
    "admin-a": ("tok-admin-a", Role.ADMIN, "a"),
    "prod-a": ("tok-prod-a", Role.PRODUCER, "a"),
    "prod-b": ("tok-prod-b", Role.PRODUCER, "b"),
    "scrape-b": ("tok-scrape-b", Role.METRICS, "b"),
}


def bearer(name: str, extra: bytes = b"") -> bytes:
    return b"content-type: application/json\r\nauthorization: Bearer %s\r\n%s" % (
        TOKENS[name][0].encode(), extra)  # fmt: skip


@pytest.fixture
def token_pair() -> Iterator[tuple[Server, Server]]:
    table = TokenTable([TokenEntry(name=n, sha256=hash_token(t), role=r, namespace=ns)
                        for n, (t, r, ns) in TOKENS.items()])  # fmt: skip
    lanes = _serve(Settings(direct_lane=True), table)
    plain = _serve(Settings(direct_lane=False), table)
    servers = (next(lanes), next(plain))
    try:
        for s in servers:
            put = http("PUT", "/routes/orders", ROUTE, headers=bearer("admin-a"))
            assert exchange(s.port, put)[0] == 200
            s.ways.clear()
        yield servers
    finally:
        for gen in (lanes, plain):
            gen.close()


#: (case, headers, path, body, status, the lane's way)
TOKEN_CASES = [
    ("producer", bearer("prod-a"), "/select", {"topic": "orders"}, 200, "direct"),
    ("other namespace", bearer("prod-b"), "/select", {"topic": "orders"}, 404, "direct"),
    ("report", bearer("prod-a"), "/report-latency",
     {"brokerName": "broker-a", "latencyMs": 5000, "producer": "p1"}, 200, "direct"),
    ("no token", b"content-type: application/json\r\n", "/select", {"topic": "orders"}, 401,
     "declined"),
    ("unknown token", b"content-type: application/json\r\nauthorization: Bearer nope\r\n",
     "/select", {"topic": "orders"}, 401, "declined"),
    ("namespace mismatch", bearer("prod-a", b"x-detour-namespace: b\r\n"), "/select",
     {"topic": "orders"}, 403, "declined"),
    ("role may not", bearer("scrape-b"), "/select", {"topic": "orders"}, 403, "declined"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "headers", "path", "body", "status", "way"), TOKEN_CASES,
                         ids=[c[0] for c in TOKEN_CASES])  # fmt: skip
def test_tokens_are_checked_as_the_guard_checks_them(
    token_pair: tuple[Server, Server], name: str, headers: bytes, path: str,
    body: dict[str, Any], status: int, way: str,
) -> None:  # fmt: skip
    mask = ("brokerName", "queueId", "availableAt") if status == 200 else ()
    answer, _ = both(token_pair, http("POST", path, body, headers=headers), mask)
    assert answer[0] == status
    assert token_pair[0].ways == [way]


def test_a_tokens_report_lands_in_its_namespace(token_pair: tuple[Server, Server]) -> None:
    """The lane gives the report the guard's principal and store (``report_in`` is the
    endpoint's own): the same item and event on both servers, in namespace a only."""
    report = http("POST", "/report-latency",
                  {"brokerName": "broker-b", "isolation": True, "latencyMs": 1,
                   "producer": "p7"}, headers=bearer("prod-a"))  # fmt: skip
    seen = []
    for server in token_pair:
        assert exchange(server.port, report)[0] == 200
        state = []
        for path in ("/fault-items", "/events"):
            status, _, body = exchange(server.port, http("GET", path, headers=bearer("admin-a")))
            assert status == 200
            rows = json.loads(body)["items" if path == "/fault-items" else "events"]
            # times differ between the two runs: the window end, the event's, the why's
            state.append([{k: (v if k != "why" else {**v, "since": 0})
                           for k, v in r.items() if k not in ("availableAt", "at", "id")}
                          for r in rows])  # fmt: skip
        seen.append(state)
    assert token_pair[0].ways == ["direct"]
    assert seen[0] == seen[1]
    assert [r["brokerName"] for r in seen[0][0]] == ["broker-b"]


def test_a_burst_larger_than_the_outbox_comes_back_whole_and_in_order(
    pair: tuple[Server, Server],
) -> None:
    """250 pipelined selects in one write (about 80 KiB of answers, past the 64 KiB a
    connection may hold for the end of the turn; under the in-flight bound of 256 one
    turn may start): every answer, in the walk's order."""
    lane = pair[0]
    with socket.create_connection(("127.0.0.1", lane.port), timeout=30) as s:
        s.sendall(http("POST", "/select", {"topic": "orders"}) * 250)
        answers = read_answers(s, 250)
    assert {a[0] for a in answers} == {200}
    positions = [_position(a) for a in answers]
    assert all((b - a) % len(QUEUES) == 1 for a, b in pairwise(positions)), positions
    # The first ones directly; once the unread answers pause the writer, the rest the
    # ASGI way (uvicorn then stops reading until the client reads).
    assert lane.ways[0] == "direct"


class StoppingProtocol(RecordingProtocol):
    headed: threading.Event
    shut: threading.Event

    def _start(self, edge: Any, path: bytes) -> None:
        super()._start(edge, path)
        if self._direct is not None:
            StoppingProtocol.headed.set()

    def shutdown(self) -> None:
        super().shutdown()
        StoppingProtocol.shut.set()


def test_a_request_being_read_when_the_server_stops_is_answered_then_closed() -> None:
    """Graceful stop (SIGTERM): a request whose head is in is answered, as uvicorn's own
    cycle would be, and the connection then closes."""
    StoppingProtocol.headed = threading.Event()
    StoppingProtocol.shut = threading.Event()
    with running(Settings(), protocol=StoppingProtocol) as (port, server):
        assert exchange(port, http("PUT", "/routes/orders", ROUTE))[0] == 200
        request = http("POST", "/select", {"topic": "orders"})
        cut = request.index(b"\r\n\r\n") + 6
        with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
            s.sendall(request[:cut])
            assert StoppingProtocol.headed.wait(15), "the lane took the head"
            server.should_exit = True
            assert StoppingProtocol.shut.wait(15), "the server asked the connection to stop"
            s.sendall(request[cut:])
            ((status, heads, _),) = read_answers(s, 1)
            assert (status, heads.get("connection")) == (200, "close")
            assert s.recv(1) == b""
        assert WAYS[port] == ["direct"]
