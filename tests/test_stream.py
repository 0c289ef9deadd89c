"""GET /fault-items/stream against a live service on both stores: the push cached clients follow."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.procs import PATIENT_ENV, ServiceProcess

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["memory", "redis"])
def service(request: pytest.FixtureRequest) -> Iterator[ServiceProcess]:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    # A long grace, so a stop that waited for the open streams would stand out on a busy
    # machine (test_stream_ends_when_the_replica_stops).
    svc = ServiceProcess(redis_url=url, env={**PATIENT_ENV, "DETOUR_SHUTDOWN_GRACE_S": "60"})
    try:
        yield svc
    finally:
        svc.stop()


def events(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    kind = ""
    for line in lines:
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield kind, json.loads(line.removeprefix("data: "))


def next_event(it: Iterator[tuple[str, dict[str, Any]]], kind: str) -> dict[str, Any]:
    for _ in range(50):  # clock events may come between
        k, data = next(it)
        if k == kind:
            return data
    raise AssertionError(f"no {kind} event")


def test_stream_sends_a_snapshot_then_changes(service: ServiceProcess) -> None:
    with httpx.Client(base_url=service.url, timeout=5) as c:
        c.put("/routes/t", json={"brokers": [{"brokerName": "x", "writeQueueNums": 2}]})
        c.post("/report-latency", json={"brokerName": "x", "latencyMs": 700})
        with c.stream("GET", "/fault-items/stream") as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            it = events(r.iter_lines())
            snap = next_event(it, "snapshot")
            assert snap["config"]["latencyMax"] == [50, 100, 550, 1000, 2000, 3000, 15000]
            assert snap["routes"] == [{"topic": "t", "brokers": [
                {"brokerName": "x", "writeQueueNums": 2, "address": None}]}]
            assert [i["brokerName"] for i in snap["items"]] == ["x"]
            assert snap["now"] > 0

            end = c.post("/report-latency", json={"brokerName": "y", "latencyMs": 0,
                                                  "isolation": True}).json()["availableAt"]
            fault = next_event(it, "fault")
            # With what a select reads of the item, so cached clients decide as /select.
            assert fault == {"brokerName": "y", "currentLatencyMs": 0, "availableAt": end,
                             "isolations": 0, "suspects": [], "probation": False,
                             "reachable": None, "slow": [], "pending": [],
                             # why its window is open: the report that set it
                             "why": {"reason": "isolation", "latencyMs": 0, "by": "",
                                     "since": pytest.approx(end - 600000, abs=5000)},
                             "now": pytest.approx(end - 600000, abs=5000),
                             "version": fault["version"]}
            assert fault["version"] > 0
            c.delete("/fault-items/y")
            fault = next_event(it, "fault")
            assert (fault["brokerName"], fault["deleted"]) == ("y", True)
            c.put("/routes/u", json={"brokers": [{"brokerName": "z", "writeQueueNums": 1}]})
            assert next_event(it, "route")["topic"] == "u"
            c.delete("/routes/u")
            deleted = next_event(it, "route")
            assert (deleted["topic"], deleted["deleted"]) == ("u", True)
            assert deleted["version"] > fault["version"]
            c.patch("/config", json={"isolationLatencyMs": 5000})
            assert next_event(it, "config")["isolationLatencyMs"] == 5000
            clock = next_event(it, "clock")
            assert clock["now"] >= snap["now"]


def test_stream_ends_when_the_replica_stops(service: ServiceProcess) -> None:
    """A stop must not wait out the grace period for push streams; clients reconnect."""
    import signal
    import time

    with httpx.Client(base_url=service.url, timeout=10) as c, \
            c.stream("GET", "/fault-items/stream") as r:
        it = events(r.iter_lines())
        next_event(it, "snapshot")
        start = time.monotonic()
        service.proc.send_signal(signal.SIGTERM)
        for _ in it:  # ends when the server closes the stream
            pass
        assert service.proc.wait(30) == 0
        assert time.monotonic() - start < 20  # far below the 60 s grace
