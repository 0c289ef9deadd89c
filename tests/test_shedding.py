"""Fast failure under overload: refuse at once with SYSTEM_BUSY instead of queueing."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import httpx
import pytest

from service.shedding import ARRIVED, Shedder
from tests.procs import ServiceProcess, wait_until

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


@pytest.mark.e2e
def test_the_server_refuses_past_the_in_flight_bound_before_the_app_runs() -> None:
    """A report whose body is still arriving holds the one slot of a bound of 1: the
    next requests are refused by the protocol itself, at once, on a connection that
    stays usable; once the body is complete the held report is answered and requests
    pass again."""
    body = json.dumps({"brokerName": "a", "latencyMs": 1}).encode()
    # A queue-wait budget no loaded machine reaches: every refusal here is the bound's.
    env = {"DETOUR_MAX_IN_FLIGHT": "1", "DETOUR_MAX_QUEUE_WAIT_MS": "60000"}
    with ServiceProcess(env=env) as svc, \
            httpx.Client(base_url=svc.url, timeout=5) as c, \
            socket.create_connection(("127.0.0.1", svc.port), timeout=5) as slow:
        c.put("/routes/t", json={"brokers": [{"brokerName": "a", "writeQueueNums": 1}]})
        slow.sendall(b"POST /report-latency HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
                     + body[:5])
        wait_until(lambda: c.post("/select", json={"topic": "t"}).status_code == 503,
                   10, "the slow report in flight")
        for _ in range(20):
            start = time.perf_counter()
            r = c.post("/select", json={"topic": "t"})
            assert time.perf_counter() - start < 0.05
            assert r.status_code == 503 and r.json()["error"] == "SYSTEM_BUSY"
            assert r.headers["retry-after"] == "1"
        # A body the app never reads does not break the connection.
        big = c.post("/report-latency:batch", content=b'{"reports": [' + b" " * 50_000 + b"]}",
                     headers={"content-type": "application/json"})
        assert big.status_code == 503
        assert c.get("/healthz").status_code == 200  # same connection; probes never shed
        slow.sendall(body[5:])
        answer = slow.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        # The slot frees when the held request's task ends, just after its answer.
        wait_until(lambda: c.post("/select", json={"topic": "t"}).status_code == 200,
                   10, "the slot freed")
        shed = [ln for ln in c.get("/metrics").text.splitlines()
                if ln.startswith('detour_requests_shed_total{reason="in_flight"}')]
        assert len(shed) == 1 and float(shed[0].split()[-1]) >= 22


def test_only_unfinished_tasks_count_toward_the_bound() -> None:
    """A task whose answer went out stays in uvicorn's set until its done-callback runs;
    it must not take a slot, or clients that wait for their answer get refused."""
    async def scenario() -> None:
        shed = Shedder(Gate(), max_in_flight=2, max_queue_wait_ms=200)
        gate = asyncio.Event()
        done = asyncio.create_task(asyncio.sleep(0))
        await done
        waiting = asyncio.create_task(gate.wait())
        tasks = {done, waiting}
        assert not shed.over_bound(tasks)  # two in the set, one unfinished
        also = asyncio.create_task(gate.wait())
        tasks.add(also)
        assert shed.over_bound(tasks)  # two unfinished
        shed.streams = 1  # an open push stream is not work in flight
        assert not shed.over_bound(tasks)
        gate.set()
        await asyncio.gather(waiting, also)

    asyncio.run(scenario())
