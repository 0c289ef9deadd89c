"""Fast failure under overload: refuse at once with SYSTEM_BUSY instead of queueing."""

from __future__ import annotations

import asyncio
import json
import select
import signal
import socket
import time
from typing import Any

import httpx
import pytest

from service.edge.shedding import ARRIVED, Saturation, Shedder, TurnBudget
from tests.procs import RedisServer, ServiceProcess, wait_until

pytestmark = pytest.mark.integration


class Gate:
    """A downstream app whose requests wait until released: requests in flight, on demand."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.entered += 1
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def scope(path: str, **extra: Any) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": path, "headers": [], **extra}


async def call(app: Any, s: dict[str, Any]) -> tuple[int, dict[bytes, bytes], bytes]:
    out: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        out.append(message)

    await app(s, receive, send)
    return out[0]["status"], dict(out[0]["headers"]), out[1]["body"]


def test_in_flight_limit_refuses_at_once_and_frees_its_slots() -> None:
    async def scenario() -> None:
        gate = Gate()
        shed = Shedder(gate, max_in_flight=2, max_queue_wait_ms=200)
        held = [asyncio.create_task(call(shed, scope("/select"))) for _ in range(2)]
        for _ in range(1000):  # bounded: both get inside the app within a few loop turns
            if gate.entered == 2:
                break
            await asyncio.sleep(0)
        assert gate.entered == 2
        start = time.perf_counter()
        status, headers, body = await call(shed, scope("/select"))
        assert time.perf_counter() - start < 0.005
        assert (status, headers[b"retry-after"]) == (503, b"1")
        assert b'"error": "SYSTEM_BUSY"' in body
        assert shed.shedding_until > time.monotonic_ns()  # a refusal starts shedding
        # Once the held requests finish, their slots are free again.
        gate.release.set()
        assert [r[0] for r in await asyncio.gather(*held)] == [200, 200]
        assert shed.in_flight == 0
        assert (await call(shed, scope("/select")))[0] == 200

    asyncio.run(scenario())


def test_probes_are_never_shed() -> None:
    async def scenario() -> None:
        gate = Gate()
        gate.release.set()
        shed = Shedder(gate, max_in_flight=1, max_queue_wait_ms=0)
        late = time.monotonic_ns() - 10_000_000
        for path in ("/healthz", "/readyz", "/metrics"):
            assert (await call(shed, scope(path, **{ARRIVED: late})))[0] == 200
        assert (await call(shed, scope("/select", **{ARRIVED: late})))[0] == 503

    asyncio.run(scenario())


def test_a_request_that_waited_too_long_is_refused() -> None:
    async def scenario() -> None:
        gate = Gate()
        gate.release.set()
        shed = Shedder(gate, max_in_flight=10, max_queue_wait_ms=50)
        fresh = time.monotonic_ns()
        stale = fresh - 60_000_000
        assert (await call(shed, scope("/select", **{ARRIVED: fresh})))[0] == 200
        assert (await call(shed, scope("/select", **{ARRIVED: stale})))[0] == 503

    asyncio.run(scenario())


@pytest.mark.e2e
def test_the_server_stamps_arrival_so_queue_wait_sheds_end_to_end() -> None:
    """With a 0 ms budget every request has waited too long: proof the protocol's stamp
    reaches the shedder in the real server, counted in the metric, probes untouched."""
    svc = ServiceProcess(env={"DETOUR_MAX_QUEUE_WAIT_MS": "0"})
    try:
        with httpx.Client(base_url=svc.url, timeout=5) as c:
            r = c.post("/select", json={"topic": "t"})
            assert r.status_code == 503 and r.json()["error"] == "SYSTEM_BUSY"
            assert r.headers["retry-after"] == "1"
            assert c.get("/healthz").status_code == 200
            text = c.get("/metrics").text
            assert 'detour_requests_shed_total{reason="queue_wait"} 1.0' in text
    finally:
        svc.stop()


def hold_a_slot(port: int, body: bytes, probe: Any) -> socket.socket:
    """A report waiting on a Redis the caller has stopped (SIGSTOP), inside the app: a
    connection holding one in-flight slot. (A body still arriving no longer holds one:
    the protocol does not count it as in flight.) The request before it may still be
    finishing (a handler returns a moment after its answer went out), and then this report
    is the one refused: send it again on a new connection. Held once ``probe()`` (another
    request) is refused."""
    request = (b"POST /report-latency HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json"
               b"\r\ncontent-length: %d\r\n\r\n" % len(body)) + body
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        slow = socket.create_connection(("127.0.0.1", port), timeout=5)
        slow.sendall(request)
        while time.monotonic() < deadline:
            if probe().status_code == 503:
                return slow
            readable, _, _ = select.select([slow], [], [], 0)
            if readable:  # refused itself: the slot was still taken
                slow.close()
                break
    raise TimeoutError("no slot held within 10 s")


#: A Redis call that waits as long as the test needs: a report on a stopped Redis stays in
#: the app (and the once-a-minute sync does not notice the stop meanwhile).
HOLD_ENV = {"DETOUR_REDIS_CALL_TIMEOUT_S": "30", "DETOUR_SYNC_INTERVAL_S": "60"}


@pytest.mark.e2e
def test_the_server_refuses_past_the_in_flight_bound_before_the_app_runs() -> None:
    """A report waiting on a stopped Redis holds the one slot of a bound of 1: the
    next requests are refused by the protocol itself, at once, on a connection that
    stays usable; once Redis answers the held report is answered and requests pass
    again."""
    body = json.dumps({"brokerName": "a", "latencyMs": 1}).encode()
    # A queue-wait budget no loaded machine reaches: every refusal here is the bound's.
    env = {"DETOUR_MAX_IN_FLIGHT": "1", "DETOUR_MAX_QUEUE_WAIT_MS": "60000", **HOLD_ENV}
    redis = RedisServer()
    try:
        with ServiceProcess(redis_url=redis.url, env=env) as svc, \
                httpx.Client(base_url=svc.url, timeout=5) as c:
            c.put("/routes/t", json={"brokers": [{"brokerName": "a", "writeQueueNums": 1}]})
            redis.proc.send_signal(signal.SIGSTOP)
            with hold_a_slot(svc.port, body,
                             lambda: c.post("/select", json={"topic": "t"})) as slow:
                for _ in range(20):
                    start = time.perf_counter()
                    r = c.post("/select", json={"topic": "t"})
                    # At once, not after the held slot. Generous for a busy machine:
                    # the refusal's speed is bench/overload.py's.
                    assert time.perf_counter() - start < 1.0
                    assert r.status_code == 503 and r.json()["error"] == "SYSTEM_BUSY"
                    assert r.headers["retry-after"] == "1"
                # A body the app never reads does not break the connection.
                big = c.post("/report-latency:batch",
                             content=b'{"reports": [' + b" " * 50_000 + b"]}",
                             headers={"content-type": "application/json"})
                assert big.status_code == 503
                assert c.get("/healthz").status_code == 200  # same connection; never shed
                redis.proc.send_signal(signal.SIGCONT)
                answer = slow.recv(4096)
                assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
                # The slot frees when the held request's task ends, just after its answer.
                wait_until(lambda: c.post("/select", json={"topic": "t"}).status_code == 200,
                           10, "the slot freed")
            shed = [ln for ln in c.get("/metrics").text.splitlines()
                    if ln.startswith('detour_requests_shed_total{reason="in_flight"}')]
            assert len(shed) == 1 and float(shed[0].split()[-1]) >= 22
    finally:
        redis.proc.send_signal(signal.SIGCONT)
        redis.stop()


def test_a_request_counts_from_the_turn_that_starts_it_until_its_app_call_returns() -> None:
    """In flight = inside the app plus started by this turn (their tasks run only after
    the turn has read everything). A request frees its slot when its app call returns,
    even while uvicorn has not yet reaped its task."""
    async def scenario() -> None:
        gate = Gate()
        shed = Shedder(gate, max_in_flight=2, max_queue_wait_ms=200)
        assert [shed.refusal(), shed.refusal(), shed.refusal()] == [None, None, "in_flight"]
        await asyncio.sleep(0)  # the turn ends; nothing was started for real
        held = asyncio.create_task(call(shed, scope("/select")))
        for _ in range(100):  # bounded: it gets inside the app within a few loop turns
            if gate.entered == 1:
                break
            await asyncio.sleep(0)
        assert shed.in_flight == 1
        assert [shed.refusal(), shed.refusal()] == [None, "in_flight"]
        gate.release.set()
        assert (await held)[0] == 200
        await asyncio.sleep(0)
        assert shed.in_flight == 0
        assert [shed.refusal(), shed.refusal()] == [None, None]

    asyncio.run(scenario())


class CpuClock:
    """A thread CPU clock the test moves by hand."""

    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def test_turn_budget_halves_the_limit_after_a_long_turn_and_adds_one_after_a_short() -> None:
    cpu = CpuClock()
    turns = TurnBudget(budget_ms=1.0, ceiling=64, cpu_ns=cpu)
    assert turns.limit == 64
    limits = []
    for used_ms in (5, 5, 5, 5, 5, 5, 5, 0.2, 0.2, 3, 0.9):
        cpu.ns += int(used_ms * 1_000_000)
        turns.begin()
        limits.append(turns.limit)
    assert limits == [32, 16, 8, 4, 2, 1, 1, 2, 3, 1, 2]
    # A turn may start as many requests as its limit, counted from its beginning.
    assert turns.may_start()
    turns.started = 2
    assert not turns.may_start()
    cpu.ns += 100_000
    turns.begin()
    assert turns.started == 0 and turns.limit == 3
    for _ in range(100):  # never past the ceiling
        turns.begin()
    assert turns.limit == 64


def test_a_saturated_window_squeezes_the_limit_below_one_start_a_turn() -> None:
    """Short turns alone do not bound the rate: one start a turn is thousands a second.
    A saturated window while shedding halves the limit, below one too; below one, a
    turn may start one request only once the fractions add up to one. While squeezed,
    short turns do not grow it; after, it grows 5% a turn up to one, then one a turn."""
    cpu = CpuClock()
    turns = TurnBudget(budget_ms=1.0, ceiling=8, cpu_ns=cpu)

    def turn(used_ms: float = 0.1) -> int:
        cpu.ns += int(used_ms * 1_000_000)
        turns.begin()
        return turns.allowed

    for _ in range(4):
        turn(5)  # long turns: 8 -> 4 -> 2 -> 1, and a long turn alone stops at one
    assert turns.limit == 1
    turns.squeeze(True)
    assert turns.limit == 0.5
    assert [turn() for _ in range(6)] == [0, 1, 0, 1, 0, 1]  # every other turn
    assert turns.limit == 0.5  # short turns, but squeezed: no growth
    turns.squeeze(True)
    assert [turn() for _ in range(8)] == [0, 0, 0, 1, 0, 0, 0, 1]
    for _ in range(20):
        turns.squeeze(True)
    assert turns.limit == TurnBudget.FLOOR
    assert sum(turn() for _ in range(512)) == 2  # one start every 256 turns
    assert turns.limit == TurnBudget.FLOOR
    turns.squeeze(False)  # an unsaturated window: it grows back, doubled at once
    assert turns.limit == 2 * TurnBudget.FLOOR and not turns.squeezed
    grown = [turns.limit]
    for _ in range(103):
        turn()
        grown.append(turns.limit)
    assert all(b == min(1.0, a * TurnBudget.REGROWTH) or b == a + 1
               for a, b in zip(grown, grown[1:], strict=False))
    assert 1 < turns.limit < 8  # back to one within about 100 turns, then one a turn
    turn(5)
    assert turns.limit >= 1  # a long turn halves, but not below one


def test_a_squeeze_without_a_budget_changes_nothing() -> None:
    turns = TurnBudget(budget_ms=0, ceiling=8, cpu_ns=CpuClock())
    turns.squeeze(True)
    turns.begin()
    assert turns.limit == 8 and turns.allowed == 8 and not turns.squeezed


def test_a_zero_turn_budget_never_limits() -> None:
    cpu = CpuClock()
    turns = TurnBudget(budget_ms=0, ceiling=8, cpu_ns=cpu)
    for _ in range(5):
        cpu.ns += 10**9
        turns.begin()
    assert turns.limit == 8


def held_saturation(saturated: bool) -> Saturation:
    """A ``Saturation`` whose clocks never move: it stays as it is set."""
    still = CpuClock()
    sat = Saturation(lambda: 1.0, cpu_ns=still, wall_ns=still)
    sat.saturated = saturated
    return sat


def test_saturation_is_the_share_used_of_the_cpu_the_loop_may_use() -> None:
    cpu, wall = CpuClock(), CpuClock()
    sat = Saturation(lambda: 1.0, threshold=0.85, window_ms=100, cpu_ns=cpu, wall_ns=wall)
    ms = 1_000_000
    wall.ns, cpu.ns = 99 * ms, 99 * ms
    assert not sat.update()  # the window is not over yet: nothing judged
    assert not sat.saturated
    wall.ns, cpu.ns = 100 * ms, 99 * ms
    assert sat.update()  # the window closed
    assert sat.saturated  # 99 ms of CPU in 100 ms
    wall.ns, cpu.ns = 300 * ms, 199 * ms
    sat.update()
    assert not sat.saturated  # half of the next 200 ms
    wall.ns, cpu.ns = 400 * ms, 284 * ms
    sat.update()
    assert sat.saturated  # 85 ms of 100: the threshold itself counts


def test_under_a_quota_saturation_is_judged_against_the_quota() -> None:
    """A process capped at 0.3 cores that uses 0.28 of wall time is saturated; without
    the cap, the same use is not."""
    ms = 1_000_000
    for cores, expected in ((0.3, True), (1.0, False)):
        cpu, wall = CpuClock(), CpuClock()
        sat = Saturation(lambda c=cores: c, window_ms=100, cpu_ns=cpu, wall_ns=wall)
        wall.ns, cpu.ns = 100 * ms, 28 * ms
        sat.update()
        assert sat.saturated is expected


def turn_limited(saturated: bool) -> tuple[Shedder, CpuClock]:
    """A shedder with a bound of 3 in flight, a 1 ms turn budget and a long hold, its
    turns judged on a CPU clock the test moves."""
    shed = Shedder(Gate(), max_in_flight=3, max_queue_wait_ms=200,
                   turn_budget_ms=1.0, shedding_hold_s=60,
                   saturation=held_saturation(saturated))
    cpu = CpuClock()
    shed.turns = TurnBudget(1.0, 3, cpu_ns=cpu)
    return shed, cpu


def test_the_turn_limit_applies_only_while_shedding() -> None:
    """Bursts pass while the service keeps up; from the first refusal until the hold
    runs out, each turn starts only its limit and refuses the rest at once."""
    async def scenario() -> None:
        shed, cpu = turn_limited(False)
        cpu.ns = 10**9  # the turn before was long: the limit halves to 1
        first = [shed.refusal() for _ in range(4)]
        assert shed.turns.limit == 1
        assert first == [None, None, None, "in_flight"]  # not shedding: a burst of 3 passes
        assert shed.shedding_until > time.monotonic_ns()
        await asyncio.sleep(0)
        cpu.ns += 10**9
        assert [shed.refusal() for _ in range(3)] == [None, "turn_budget", "turn_budget"]
        # The hold runs out: the limit no longer applies.
        shed.shedding_until = time.monotonic_ns()
        await asyncio.sleep(0)
        cpu.ns += 10**9
        assert [shed.refusal() for _ in range(3)] == [None, None, None]

    asyncio.run(scenario())


@pytest.mark.parametrize("saturated", [False, True])
def test_the_turn_limits_refusals_prolong_shedding_only_while_saturated(
        saturated: bool) -> None:
    """Shedding ends a hold after the last in-flight refusal while the turn limit keeps
    refusing, if the loop has CPU to spare: a service that keeps up again stops
    shedding. A saturated loop keeps shedding: the limit's refusals renew the hold."""
    async def scenario() -> None:
        shed, cpu = turn_limited(saturated)
        cpu.ns = 10**9
        assert [shed.refusal() for _ in range(4)][-1] == "in_flight"
        until = shed.shedding_until
        await asyncio.sleep(0)
        cpu.ns += 10**9
        assert [shed.refusal() for _ in range(3)] == [None, "turn_budget", "turn_budget"]
        if saturated:
            assert shed.shedding_until > until
        else:
            assert shed.shedding_until == until

    asyncio.run(scenario())


def test_a_saturated_window_while_shedding_squeezes_and_the_squeeze_holds_shedding() -> None:
    """Windows close at turn starts. One that closes saturated while the service sheds
    halves the turn limit below one; the limit's refusals then renew the hold even once
    the loop is no longer saturated, because a lapse would start every waiting request
    at once. The same window outside shedding squeezes nothing."""
    async def scenario() -> None:
        ms = 1_000_000
        cpu, wall = CpuClock(), CpuClock()
        shed = Shedder(Gate(), max_in_flight=3, max_queue_wait_ms=200, turn_budget_ms=1.0,
                       shedding_hold_s=60,
                       saturation=Saturation(lambda: 1.0, window_ms=100, cpu_ns=cpu,
                                             wall_ns=wall))
        turn_cpu = CpuClock()
        shed.turns = TurnBudget(1.0, 3, cpu_ns=turn_cpu)

        async def turn(wall_ms: float, cpu_ms: float, requests: int) -> list[str | None]:
            wall.ns += int(wall_ms * ms)
            cpu.ns += int(cpu_ms * ms)
            turn_cpu.ns += int(cpu_ms * ms)
            out: list[str | None] = [shed.refusal() for _ in range(requests)]
            await asyncio.sleep(0)  # the turn ends
            return out

        # A saturated window outside shedding: nothing squeezed, a burst of 3 passes.
        assert await turn(100, 100, 3) == [None, None, None]
        assert shed.turns.limit == 1 and not shed.turns.squeezed
        # In flight fills: shedding starts (hold 60 s).
        shed.in_flight = 3
        assert (await turn(0.1, 0, 1)) == ["in_flight"]
        shed.in_flight = 0
        # The next window closes saturated while shedding: from the next turn on, the
        # limit is 1/2, one start every other turn.
        assert await turn(100, 100, 2) == [None, "turn_budget"]
        assert shed.turns.limit == 0.5 and shed.turns.squeezed
        assert await turn(0.1, 0.01, 2) == ["turn_budget", "turn_budget"]
        assert await turn(0.1, 0.01, 2) == [None, "turn_budget"]
        # The loop is no longer saturated, but the limit is still below one: the hold
        # is renewed (without a squeeze it would not be: the test above).
        shed.saturation.saturated = False
        shed.shedding_until = time.monotonic_ns() + 10**9
        before = shed.shedding_until
        assert await turn(0.1, 0.01, 2) == ["turn_budget", "turn_budget"]
        assert shed.shedding_until > before
        # An unsaturated window ends the squeeze: the limit grows back past one.
        await turn(100, 10, 1)
        assert not shed.turns.squeezed
        for _ in range(30):
            await turn(0.1, 0.01, 1)
        assert shed.turns.limit >= 1

    asyncio.run(scenario())


def test_unsaturated_windows_bring_a_squeezed_limit_back_however_few_the_turns() -> None:
    """SDK producers backing off send one request a turn, seconds apart. After an
    overload squeezed the limit to the floor, 5% a turn would take about 114 of those,
    each refused and each renewing the hold: a replica with CPU to spare kept refusing
    report batches for minutes (measured with bench/producers.py). Each window that
    closes unsaturated doubles the limit instead: one request a window is started again
    by the eighth window, and shedding then lapses on its own."""
    async def scenario() -> None:
        ms = 1_000_000
        cpu, wall = CpuClock(), CpuClock()
        shed = Shedder(Gate(), max_in_flight=3, max_queue_wait_ms=200, turn_budget_ms=1.0,
                       shedding_hold_s=60,
                       saturation=Saturation(lambda: 1.0, window_ms=100, cpu_ns=cpu,
                                             wall_ns=wall))
        turn_cpu = CpuClock()
        shed.turns = TurnBudget(1.0, 3, cpu_ns=turn_cpu)

        async def turn(wall_ms: float, cpu_ms: float) -> str | None:
            wall.ns += int(wall_ms * ms)
            cpu.ns += int(cpu_ms * ms)
            turn_cpu.ns += int(cpu_ms * ms)
            out = shed.refusal()
            await asyncio.sleep(0)  # the turn ends
            return out

        shed.in_flight = 3
        assert await turn(0.1, 0) == "in_flight"  # shedding starts
        shed.in_flight = 0
        for _ in range(12):  # saturated windows while shedding: down to the floor
            await turn(100, 100)
        assert shed.turns.limit == TurnBudget.FLOOR
        # Now one request a window, the loop nearly idle: each closes a window unsaturated.
        outcomes = [await turn(500, 0.05) for _ in range(8)]
        assert outcomes[-1] is None, outcomes  # started again by the eighth
        assert shed.turns.limit == 1
        assert outcomes.count("turn_budget") <= 7

    asyncio.run(scenario())


def read_responses(sock: socket.socket, n: int) -> list[bytes]:
    """The status lines of the next ``n`` HTTP/1.1 responses on ``sock`` (bounded by the
    socket's timeout)."""
    buf, out = b"", []
    while len(out) < n:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = buf[:end].decode("latin-1")
            length = int(next(ln.split(":", 1)[1] for ln in head.split("\r\n")
                              if ln.lower().startswith("content-length")))
            if len(buf) >= end + 4 + length:
                out.append(head.split("\r\n", 1)[0].encode())
                buf = buf[end + 4 + length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, "connection closed early"
        buf += chunk
    return out


@pytest.mark.e2e
def test_the_server_refuses_past_the_turn_limit_while_shedding() -> None:
    """The real server: two reports waiting on a stopped Redis hold two of four
    slots; three pipelined selects in one write overflow the bound (shedding begins);
    with a budget every turn exceeds, the limit is one start per turn, so of the next
    two pipelined selects the second is refused for the turn, in order, at once."""
    select = (b"POST /select HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
              b"content-length: 13\r\n\r\n{\"topic\":\"t\"}")
    report = json.dumps({"brokerName": "a", "latencyMs": 1}).encode()
    env = {"DETOUR_MAX_IN_FLIGHT": "4", "DETOUR_TURN_BUDGET_MS": "0.000001",
           "DETOUR_MAX_QUEUE_WAIT_MS": "60000", **HOLD_ENV}
    redis = RedisServer()
    try:
        with ServiceProcess(redis_url=redis.url, env=env) as svc, \
                httpx.Client(base_url=svc.url, timeout=5) as c:
            c.put("/routes/t", json={"brokers": [{"brokerName": "a", "writeQueueNums": 1}]})
            redis.proc.send_signal(signal.SIGSTOP)  # the two reports wait inside the app
            holders = []
            for _ in range(2):
                h = socket.create_connection(("127.0.0.1", svc.port), timeout=5)
                h.sendall(b"POST /report-latency HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
                          b"application/json\r\ncontent-length: %d\r\n\r\n" % len(report)
                          + report)
                holders.append(h)
            with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as pipe:
                def third_refused() -> bool:
                    # Once both holders are inside the app, a burst of three is one too many.
                    pipe.sendall(select * 3)
                    return read_responses(pipe, 3)[2].startswith(b"HTTP/1.1 503")

                wait_until(third_refused, 10, "the holders in flight")
                pipe.sendall(select * 2)
                assert [r[:12] for r in read_responses(pipe, 2)] == [b"HTTP/1.1 200",
                                                                    b"HTTP/1.1 503"]
            redis.proc.send_signal(signal.SIGCONT)
            for h in holders:
                assert read_responses(h, 1)[0].startswith(b"HTTP/1.1 200")
                h.close()
            shed = {ln.split('reason="')[1].split('"')[0]: float(ln.split()[-1])
                    for ln in c.get("/metrics").text.splitlines()
                    if ln.startswith("detour_requests_shed_total{")}
            assert shed["turn_budget"] == 1 and shed["in_flight"] >= 1
    finally:
        redis.proc.send_signal(signal.SIGCONT)
        redis.stop()


@pytest.mark.e2e
def test_a_request_queued_behind_another_does_not_free_a_slot_while_its_body_arrives() -> None:
    """``DETOUR_MAX_IN_FLIGHT=1``, Redis stopped: a config write waits inside the app, and
    a second one pipelined behind it on the same connection sends half its body. The
    queued one is not in the app, so its body arriving must not count as a slot given
    back: another client is refused SYSTEM_BUSY at once, not admitted to wait for Redis."""
    config = json.dumps({"lastReportWins": True}).encode()
    # PATCH: a partial PUT is refused before it reaches the store (a PUT is whole).
    put = (b"PATCH /config HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n" % len(config))
    # Every refusal here is the in-flight bound's: no turn limit while shedding (it would
    # refuse for a second after any refusal, whatever is counted), no queue-wait budget.
    env = {"DETOUR_MAX_IN_FLIGHT": "1", "DETOUR_MAX_QUEUE_WAIT_MS": "60000",
           "DETOUR_TURN_BUDGET_MS": "0", "DETOUR_REDIS_TIMEOUT_S": "30",
           # The half body waits for the test, not for its deadline (which frees it).
           "DETOUR_BODY_TIMEOUT_S": "60", **HOLD_ENV}
    redis = RedisServer()
    try:
        with ServiceProcess(redis_url=redis.url, env=env) as svc, \
                httpx.Client(base_url=svc.url, timeout=10) as c:
            c.put("/routes/t", json={"brokers": [{"brokerName": "a", "writeQueueNums": 1}]})
            redis.proc.send_signal(signal.SIGSTOP)
            with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as held:
                held.sendall(put + config + put + config[: len(config) // 2])

                def refused() -> bool:
                    return c.post("/select", json={"topic": "t"}).status_code == 503

                # bounded; a busy machine may take seconds to admit the held write
                wait_until(refused, 30, "the held write's slot counted")
                with httpx.Client(base_url=svc.url, timeout=10) as other:
                    start = time.perf_counter()
                    r = other.patch("/config", json={"lastReportWins": False})
                    waited = time.perf_counter() - start
                assert r.status_code == 503 and r.json()["error"] == "SYSTEM_BUSY", r.text
                assert waited < 0.5, waited
    finally:
        redis.proc.send_signal(signal.SIGCONT)
        redis.stop()
