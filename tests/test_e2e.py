"""The service as real processes: start-up, flags, replicas on one Redis, several workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.procs import PATIENT_ENV, ROOT, ServiceProcess, wait_until

pytestmark = pytest.mark.e2e


def test_memory_store_process_logs_its_store(tmp_path: Path) -> None:
    log = tmp_path / "detour.log"
    svc = ServiceProcess(log_path=log)
    try:
        with httpx.Client(base_url=svc.url, timeout=5) as c:
            c.put("/routes/t", json={"brokers": [{"brokerName": "a", "writeQueueNums": 1}]})
            assert c.post("/select", json={"topic": "t"}).json()["brokerName"] == "a"
            assert c.get("/readyz").json() == {"status": "ready", "store": "memory",
                                               "degraded": False}
    finally:
        svc.stop()
    assert "store=memory" in log.read_text()


def test_redis_store_process_logs_its_store(tmp_path: Path, redis_url: str) -> None:
    log = tmp_path / "detour.log"
    svc = ServiceProcess(redis_url=redis_url, log_path=log)
    svc.stop()
    text = log.read_text()
    assert "store=redis at redis://127.0.0.1:" in text
    assert text.count("detour ready") == 1


def test_environment_configures_the_process(redis_url: str) -> None:
    svc = ServiceProcess(env={"DETOUR_REDIS_URL": redis_url})
    try:
        assert httpx.get(svc.url + "/readyz", timeout=5).json()["store"] == "redis"
    finally:
        svc.stop()


def test_workers_without_redis_are_refused() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "service", "--workers", "2"], cwd=ROOT, capture_output=True,
        text=True, timeout=60,
    )
    assert out.returncode == 2
    assert "--workers > 1 needs --redis-url" in out.stderr


def _avoids(client: httpx.Client, broker: str) -> bool:
    """Two consecutive selects start at both queues of a 2-queue route: both avoid ``broker``."""
    picks = [client.post("/select", json={"topic": "t"}).json() for _ in range(2)]
    return all(p["brokerName"] != broker for p in picks)


@pytest.mark.slow
def test_a_report_on_one_replica_is_obeyed_by_another(redis_url: str) -> None:
    """Pushed, not polled: neither replica polls during the test (a 60 s interval), so
    what b obeys came by the push. How fast it comes is bench/propagation.py's figure
    (docs/BENCHMARKS.md): a busy machine says nothing about it."""
    env = {**PATIENT_ENV, "DETOUR_SYNC_INTERVAL_S": "60"}
    a, b = ServiceProcess(redis_url=redis_url, env=env), ServiceProcess(redis_url=redis_url,
                                                                         env=env)
    try:
        with httpx.Client(base_url=a.url, timeout=5) as ca, \
                httpx.Client(base_url=b.url, timeout=5) as cb:
            ca.put("/routes/t", json={"brokers": [{"brokerName": "x", "writeQueueNums": 1},
                                                  {"brokerName": "y", "writeQueueNums": 1}]})
            wait_until(lambda: cb.get("/routes/t").status_code == 200, 10, "route on b")
            for i in range(30):
                broker = "xy"[i % 2]
                r = ca.post("/report-latency",
                            json={"brokerName": broker, "latencyMs": 0, "isolation": True})
                assert r.status_code == 200 and r.json()["degraded"] is False
                wait_until(lambda b=broker: _avoids(cb, b), 10, f"b avoids {broker}")
                assert ca.delete(f"/fault-items/{broker}").status_code == 204
                wait_until(lambda b=broker: not _avoids(cb, b), 10, "restore on b")
    finally:
        a.stop()
        b.stop()


@pytest.mark.slow
def test_two_workers_share_one_table(redis_url: str) -> None:
    svc = ServiceProcess(redis_url=redis_url, workers=2, env=PATIENT_ENV)
    try:
        with httpx.Client(base_url=svc.url, timeout=5) as c:
            c.put("/routes/t", json={"brokers": [{"brokerName": "x", "writeQueueNums": 2},
                                                 {"brokerName": "y", "writeQueueNums": 2}]})
            c.post("/report-latency", json={"brokerName": "x", "latencyMs": 0, "isolation": True})
        # Fresh connections land on either worker; every one of them must avoid x.
        def all_avoid() -> bool:
            for _ in range(20):
                with httpx.Client(base_url=svc.url, timeout=5) as fresh:
                    if fresh.post("/select", json={"topic": "t"}).json()["brokerName"] == "x":
                        return False
            return True

        wait_until(all_avoid, 15, "both workers avoid x")
    finally:
        svc.stop()
