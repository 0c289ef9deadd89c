"""A Redis crash under load: no select fails, no accepted report is lost, the replay converges."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.procs import RedisServer, ServiceProcess, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class Load:
    """One producer in a thread: a select and an isolation report for a new broker, in a loop."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.failures: list[str] = []
        #: reports refused with 503 SYSTEM_BUSY: shed before anything was applied, and the
        #: producer told so (it decides locally): refused, not lost
        self.shed = 0
        self.accepted: list[tuple[str, int, bool]] = []  # broker, availableAt, degraded
        self.selects = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as c:
            for i in range(200_000):  # bounded; stopped far earlier
                if self.stop.is_set():
                    return
                try:
                    s = c.post("/select", json={"topic": "t"})
                    if s.status_code == 503 and s.json().get("error") == "SYSTEM_BUSY":
                        self.shed += 1
                    elif s.status_code != 200:
                        self.failures.append(f"select {s.status_code} {s.text}")
                    self.selects += 1
                    broker = f"b{i}"
                    r = c.post("/report-latency",
                               json={"brokerName": broker, "latencyMs": 0, "isolation": True})
                    if r.status_code == 503 and r.json().get("error") == "SYSTEM_BUSY":
                        self.shed += 1
                        continue
                    if r.status_code != 200:
                        self.failures.append(f"report {r.status_code} {r.text}")
                        continue
                    body: dict[str, Any] = r.json()
                    self.accepted.append((broker, body["availableAt"], body["degraded"]))
                except httpx.HTTPError as exc:
                    self.failures.append(f"http {exc!r}")


def test_redis_crash_under_load_loses_no_report() -> None:
    server = RedisServer(persistent=True)
    svc = ServiceProcess(redis_url=server.url, env={"DETOUR_SYNC_INTERVAL_S": "0.2"})
    restarted: RedisServer | None = None
    load = Load(svc.url)
    try:
        with httpx.Client(base_url=svc.url, timeout=5) as c:
            c.put("/routes/t", json={"brokers": [{"brokerName": f"r{i}", "writeQueueNums": 2}
                                                 for i in range(3)]})
        load.thread.start()
        wait_until(lambda: len(load.accepted) >= 100, 20, "load before the crash")
        server.kill()
        at_kill = len(load.accepted)
        wait_until(lambda: sum(d for _, _, d in load.accepted[at_kill:]) >= 100, 20,
                   "degraded reports during the outage")
        restarted = RedisServer(port=server.port, persistent=True, data_dir=server.dir)

        def converged() -> bool:
            body = httpx.get(svc.url + "/readyz", timeout=5).json()
            return body["degraded"] is False

        wait_until(converged, 30, "journal replayed after the restart", interval_s=0.05)
        at_return = len(load.accepted)
        wait_until(lambda: len(load.accepted) >= at_return + 100, 20, "load after the restart")
        load.stop.set()
        load.thread.join(10)

        assert load.failures == []
        assert load.selects >= len(load.accepted)
        journaled = [a for a in load.accepted if a[2]]
        assert len(journaled) >= 100
        with httpx.Client(base_url=svc.url, timeout=10) as c:
            table = {i["brokerName"]: i for i in c.get("/fault-items").json()["items"]}
            metrics = c.get("/metrics").text
        missing = [i for i, (b, _, _) in enumerate(load.accepted) if b not in table]
        # Where the lost ones sit among the phases says which path lost them.
        assert missing == [], (
            f"{len(missing)} of {len(load.accepted)} accepted reports not in the table: "
            f"indices {missing[0]}-{missing[-1]}, {sum(load.accepted[i][2] for i in missing)} "
            f"of them journaled; Redis killed at {at_kill}, back at {at_return}"
        )
        # Each window ends where the replica said it would when it accepted the report, to
        # the millisecond: the replay dates a report when it was accepted (ReportIn.dated).
        drift = [(b, table[b]["availableAt"] - end) for b, end, _ in load.accepted
                 if table[b]["availableAt"] != end]
        assert drift == [], f"{len(drift)} windows moved, first: {drift[:5]}"
        assert all(not table[b]["available"] for b, _, _ in load.accepted)
        assert "detour_journal_reports 0.0" in metrics
    finally:
        load.stop.set()
        svc.stop()
        if restarted is not None:
            restarted.stop()
        server.stop()


def test_sigterm_finishes_in_flight_work_and_exits_cleanly(tmp_path: Any) -> None:
    import signal
    import time

    server = RedisServer()
    log = tmp_path / "detour.log"
    svc = ServiceProcess(redis_url=server.url, log_path=log)
    load = Load(svc.url)
    try:
        with httpx.Client(base_url=svc.url, timeout=5) as c:
            c.put("/routes/t", json={"brokers": [{"brokerName": "r", "writeQueueNums": 1}]})
        load.thread.start()
        wait_until(lambda: len(load.accepted) >= 20, 20, "load")
        server.kill()  # what is accepted now stays in the journal
        at_kill = len(load.accepted)
        wait_until(lambda: len(load.accepted) >= at_kill + 5, 20, "journaled reports")
        start = time.monotonic()
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(20) == 0
        assert time.monotonic() - start < 15
        load.stop.set()
        load.thread.join(10)
        # Requests in flight when the signal came were answered; later ones were refused.
        assert not [f for f in load.failures if not f.startswith("http")]
        assert "journaled reports not in redis" in log.read_text()
    finally:
        load.stop.set()
        svc.stop()
        server.stop()
