"""The per-namespace table cap: a flood of invented broker names stays bounded everywhere."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from service.app import create_app
from service.settings import Settings
from tests import raw_table
from tests.asgi_client import TestClient
from tests.procs import PATIENT_ENV, ServiceProcess, write_tokens

CAP = 20


@pytest.fixture
def capped(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings.model_copy(update={"max_brokers": CAP}))) as c:
        yield c


def items(c: TestClient) -> dict[str, dict[str, object]]:
    return {i["brokerName"]: i for i in c.get("/fault-items").json()["items"]}


def refused(c: TestClient) -> float:
    line = 'detour_reports_refused_total{namespace="default",reason="table_full"} '
    found = [ln for ln in c.get("/metrics").text.splitlines() if ln.startswith(line)]
    assert len(found) == 1
    return float(found[0].removeprefix(line))


def isolate(name: str) -> dict[str, object]:
    return {"brokerName": name, "latencyMs": 0, "isolation": True}


@pytest.mark.integration
def test_full_of_open_windows_refuses_new_brokers_and_changes_nothing(capped: TestClient) -> None:
    refused_before = refused(capped)
    batch = {"reports": [isolate(f"b{i}") for i in range(CAP)]}
    assert capped.post("/report-latency:batch", json=batch).status_code == 200
    before = items(capped)
    assert len(before) == CAP
    r = capped.post("/report-latency", json=isolate("newcomer"))
    assert r.status_code == 409
    assert r.json()["error"] == "TABLE_FULL" and r.json()["field"] == "brokerName"
    # A batch with one new broker is refused whole: the known brokers in it are untouched.
    mixed = {"reports": [{"brokerName": "b0", "latencyMs": 15000}, isolate("newcomer")]}
    assert capped.post("/report-latency:batch", json=mixed).status_code == 409
    assert items(capped) == before
    # Known brokers still report.
    r = capped.post("/report-latency", json={"brokerName": "b1", "latencyMs": 3})
    assert r.status_code == 200
    assert refused(capped) - refused_before == 3


@pytest.mark.integration
def test_ended_windows_make_room_and_open_ones_are_kept(capped: TestClient) -> None:
    capped.post("/report-latency:batch",
                json={"reports": [isolate(f"sick{i}") for i in range(5)]})
    # Fast reports leave items whose window has already ended.
    for start in range(0, 60, 15):
        batch = {"reports": [{"brokerName": f"ok{i}", "latencyMs": 1}
                             for i in range(start, start + 15)]}
        r = capped.post("/report-latency:batch", json=batch)
        assert r.status_code == 200, r.text
        table = items(capped)
        assert len(table) <= CAP
        assert {f"sick{i}" for i in range(5)} <= table.keys()
    # The latest brokers are in; the earliest ended ones made room for them.
    assert {f"ok{i}" for i in range(45, 60)} <= table.keys()
    assert "ok0" not in table
    # The replica's copy agrees with the store (the evictions were pushed).
    picks = {capped.post("/select", json={"topic": "t", "queues": [
        {"brokerName": "ok0", "queueId": 0}, {"brokerName": "sick0", "queueId": 0}]}
    ).json()["brokerName"] for _ in range(4)}
    assert picks == {"ok0"}


@pytest.mark.e2e
@pytest.mark.slow
def test_flooding_one_namespace_leaves_the_other_alone(redis_url: str, tmp_path: Path) -> None:
    tokens = {"flood": ("tok-flood", "producer", "a"), "calm": ("tok-calm", "producer", "b"),
              "calm-admin": ("tok-calm-admin", "admin", "b"),
              "scrape": ("tok-scrape", "metrics", "*")}
    f = write_tokens(tmp_path / "tokens.json", tokens)
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    # A patient report timeout: a 900-report batch's script outlasts the 50 ms default on a
    # busy machine, and the journal it would fall back to cannot evict (only Redis can), so
    # it would refuse the wave with TABLE_FULL. This test is about the cap, not the timeout.
    env = {"DETOUR_TOKENS_FILE": str(f), "DETOUR_MAX_BROKERS": "1000",
           "DETOUR_REDIS_PREFIX": "flood", "DETOUR_LATENCY_LOG_MAX": "2000", **PATIENT_ENV}
    with ServiceProcess(redis_url=redis_url, env=env) as svc, httpx.Client(
            base_url=svc.url, timeout=10) as http:
        def h(name: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {tokens[name][0]}"}

        route = {"brokers": [{"brokerName": "real-1", "writeQueueNums": 4},
                             {"brokerName": "real-2", "writeQueueNums": 4}]}
        assert http.put("/routes/t", json=route, headers=h("calm-admin")).status_code == 200
        assert http.post("/report-latency", json=isolate("real-1"),
                         headers=h("calm")).status_code == 200
        calm_before = http.get("/fault-items", headers=h("calm-admin")).json()["items"]
        statuses = []
        for wave in range(8):
            batch = {"reports": [
                {"brokerName": f"junk-{wave}-{i}", "latencyMs": 1, "isolation": i % 100 == 0}
                for i in range(900)]}
            statuses.append(http.post("/report-latency:batch", json=batch,
                                      headers=h("flood")).status_code)
        # Every wave fits once ended windows are dropped (1% isolations stay open).
        assert statuses == [200] * 8
        assert raw_table.size(raw, "flood:{a}:faults") <= 1000
        assert set(raw.scan_iter("flood:*")) <= {
            "flood:{a}:routes", "flood:{a}:graves", "flood:{b}:graves",
            "flood:{a}:faults", "flood:{a}:meta", "flood:{a}:latency-log", "flood:{a}:events",
            "flood:{b}:faults", "flood:{b}:meta", "flood:{b}:routes", "flood:{b}:latency-log",
            "flood:{b}:events", "flood:{a}:ends", "flood:{b}:ends", "flood:{a}:writers",
            "flood:{b}:writers", "flood:{a}:writers-seen", "flood:{b}:writers-seen"}
        assert raw.xlen("flood:{a}:events") < 10_000 + 1000  # the event log is bounded too
        assert raw.xlen("flood:{a}:latency-log") < 2000 + 1000  # approximate trim
        # The other namespace: same table, still served, still reporting.
        assert http.get("/fault-items", headers=h("calm-admin")).json()["items"] == calm_before
        picks = {http.post("/select", json={"topic": "t"}, headers=h("calm")).json()[
            "brokerName"] for _ in range(4)}
        assert picks == {"real-2"}
        assert http.post("/report-latency", json=isolate("real-3"),
                         headers=h("calm")).status_code == 200
        # Metrics stay bounded: per-broker counters fold names past the cap into _other.
        text = http.get("/metrics", headers=h("scrape")).text
        brokers = {ln.split('broker="', 1)[1].split('"', 1)[0]
                   for ln in text.splitlines() if 'broker="' in ln}
        # counters: 1,000 names + _other; table gauges: at most 1,000 per namespace
        assert len(brokers) <= 2 * 1000 + 1 + 3
        assert "_other" in brokers
        avoided_a = [ln for ln in text.splitlines()
                     if ln.startswith("detour_broker_avoided{") and 'namespace="a"' in ln]
        assert 0 < len(avoided_a) <= 1000
        assert 'detour_fault_items{namespace="b"} 2.0' in text
    raw.close()
