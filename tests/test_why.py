"""Why a broker is avoided is part of its fault item (docs/semantics.md, "Why a window is
open"): every reader takes it from there, on both stores, however many events have passed.
The merge's part (the reason travels with its window end) is in tests/test_merge.py and
tests/test_scenario_redis_loss.py."""

from __future__ import annotations

import time

import pytest

from tests.asgi_client import TestClient

pytestmark = pytest.mark.integration


def items(client: TestClient) -> dict[str, dict]:
    r = client.get("/fault-items")
    assert r.status_code == 200
    return {i["brokerName"]: i for i in r.json()["items"]}


def test_each_window_says_why_it_is_open_and_who_set_it(client: TestClient) -> None:
    before = int(time.time() * 1000) - 1000
    r = client.post("/report-latency", json={"brokerName": "dead", "latencyMs": 40,
                                             "isolation": True, "producer": "p1"})
    assert r.status_code == 200, r.text
    r = client.post("/report-latency", json={"brokerName": "slow", "latencyMs": 700,
                                             "producer": "p2"})
    assert r.status_code == 200, r.text
    r = client.post("/report-latency", json={"brokerName": "fine", "latencyMs": 3})
    assert r.status_code == 200, r.text
    got = items(client)
    dead, slow = got["dead"]["why"], got["slow"]["why"]
    assert dead["reason"] == "isolation" and dead["latencyMs"] == 40 and dead["by"] == "p1"
    assert slow["reason"] == "latency" and slow["latencyMs"] == 700 and slow["by"] == "p2"
    assert before <= dead["since"] <= int(time.time() * 1000) + 1000
    assert got["fine"]["why"] is None  # no window, no reason
    # a later fast report of another producer leaves the open window, and its reason
    r = client.post("/report-latency", json={"brokerName": "dead", "latencyMs": 2,
                                             "producer": "p3"})
    assert r.status_code == 200
    assert items(client)["dead"]["why"]["by"] == "p1"
    # the gauges read the item, whatever the event log still holds
    scrape = client.get("/metrics").text
    assert ('detour_broker_avoided_reason{broker="dead",namespace="default",'
            'reason="isolation"} 1.0') in scrape
    assert ('detour_broker_avoided_reason{broker="slow",namespace="default",'
            'reason="latency"} 1.0') in scrape
    assert 'detour_broker_avoided_reason{broker="fine"' not in scrape
    assert 'detour_broker_avoided_since_seconds{broker="dead"' in scrape


def test_a_reason_outlives_any_number_of_events(client: TestClient) -> None:
    """The status page's old source, the last events, scrolled past a reason; the item does
    not: 300 other brokers' windows later, the first one still says it was a failure."""
    r = client.post("/report-latency", json={"brokerName": "first", "latencyMs": 0,
                                             "isolation": True, "producer": "p1"})
    assert r.status_code == 200
    for start in range(0, 300, 100):
        r = client.post("/report-latency:batch", json={"reports": [
            {"brokerName": f"busy-{i}", "latencyMs": 700, "producer": "p2"}
            for i in range(start, start + 100)]})
        assert r.status_code == 200, r.text
    assert items(client)["first"]["why"]["reason"] == "isolation"


def test_an_operator_delete_clears_the_window_and_its_reason(client: TestClient) -> None:
    r = client.post("/report-latency", json={"brokerName": "x", "latencyMs": 0,
                                             "isolation": True})
    assert r.status_code == 200
    assert items(client)["x"]["why"]["reason"] == "isolation"
    assert client.delete("/fault-items/x").status_code == 204
    assert "x" not in items(client)
    r = client.post("/report-latency", json={"brokerName": "x", "latencyMs": 5})
    assert items(client)["x"]["why"] is None
