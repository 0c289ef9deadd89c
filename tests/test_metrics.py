"""GET /metrics: counters from this process or all workers, broker state from the shared table."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.app import create_app
from service.settings import Settings
from tests.asgi_client import TestClient
from tests.procs import PATIENT_CALL_TIMEOUT_S, PATIENT_ENV, ServiceProcess, wait_until


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


#: Series about the process rather than a namespace's table carry no namespace label.
_PROCESS_WIDE = (
    "detour_http_",
    "detour_store_errors",
    "detour_store_roundtrip",
    "detour_requests_shed",
    "detour_journal_",
    "detour_view_resyncs",
    "detour_store_reseeds",
)


def value(text: str, name: str, namespace: str = "default", **labels: str) -> float:
    """The sample with exactly these labels, plus ``namespace`` on per-namespace series."""
    if not name.startswith(_PROCESS_WIDE):
        labels = {**labels, "namespace": namespace}
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.integration
def test_select_and_report_metrics(client: TestClient) -> None:
    client.put("/routes/t", json={"brokers": [{"brokerName": "a", "writeQueueNums": 2},
                                              {"brokerName": "b", "writeQueueNums": 2}]})
    before = client.get("/metrics").text
    client.post("/report-latency", json={"brokerName": "a", "latencyMs": 0, "isolation": True})
    client.post("/report-latency", json={"brokerName": "b", "latencyMs": 120})
    client.post("/report-latency", json={"brokerName": "b", "latencyMs": 600})
    picks = [client.post("/select", json={"topic": "t"}).json() for _ in range(8)]
    client.post("/select", json={"topic": "nope"})
    text = client.get("/metrics").text

    def delta(name: str, **labels: str) -> float:
        return value(text, name, **labels) - value(before, name, **labels)

    # b is avoided too (600 ms -> 30 s): every select is pickOneAtLeast.
    assert delta("detour_selects_total", decision="pick_one_at_least") == 8
    assert delta("detour_selects_total", decision="no_route") == 1
    avoided = sum(len(p["avoidedBrokers"]) for p in picks)
    assert delta("detour_select_avoided_total", broker="a") + \
        delta("detour_select_avoided_total", broker="b") == avoided
    assert delta("detour_reports_total", broker="a", outcome="isolation") == 1
    assert delta("detour_reports_total", broker="b", outcome="ok") == 2
    assert delta("detour_windows_opened_total", broker="a", tier="15000") == 1
    assert delta("detour_windows_opened_total", broker="b", tier="550") == 1
    # Per namespace: 0 ms in the 0.1 s bucket; 120 ms in the 0.25 s one, not in the 0.1 s one.
    assert delta("detour_reported_latency_seconds_bucket", le="0.1") == 1
    assert delta("detour_reported_latency_seconds_bucket", le="0.25") == 2
    assert value(text, "detour_broker_avoided", broker="a") == 1
    assert value(text, "detour_broker_avoided", broker="b") == 1
    assert 590 < value(text, "detour_broker_available_in_seconds", broker="a") <= 600
    assert value(text, "detour_brokers_avoided") == 2
    assert value(text, "detour_route_all_avoided", topic="t") == 1
    assert value(text, "detour_routes_all_avoided") == 1
    assert delta("detour_http_request_duration_seconds_count", route="/select", method="POST",
                 status="200") == 8
    assert delta("detour_http_request_duration_seconds_count", route="/select", method="POST",
                 status="404") == 1

    client.delete("/fault-items/b")
    text = client.get("/metrics").text
    assert value(text, "detour_broker_avoided", broker="b") == 0
    assert value(text, "detour_route_all_avoided", topic="t") == 0


@pytest.mark.integration
def test_broker_state_comes_from_the_shared_table(redis_url: str) -> None:
    settings = Settings(redis_url=redis_url, redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        a.put("/routes/t", json={"brokers": [{"brokerName": "x", "writeQueueNums": 1}]})
        a.post("/report-latency", json={"brokerName": "x", "latencyMs": 0, "isolation": True})
        wait_until(lambda: value(b.get("/metrics").text, "detour_broker_avoided", broker="x")
                   == 1, 10, "state on b")
        text = b.get("/metrics").text
        assert value(text, "detour_route_all_avoided", topic="t") == 1


@pytest.mark.e2e
@pytest.mark.slow
def test_two_workers_add_up(redis_url: str, tmp_path: Path) -> None:
    # Where Detour makes the workers' metrics directory (no PROMETHEUS_MULTIPROC_DIR given).
    svc = ServiceProcess(redis_url=redis_url, workers=2,
                         env={**PATIENT_ENV, "TMPDIR": str(tmp_path)})
    try:
        assert len(list(tmp_path.glob("detour-metrics-*"))) == 1
        with httpx.Client(base_url=svc.url, timeout=5) as c:
            c.put("/routes/t", json={"brokers": [{"brokerName": "x", "writeQueueNums": 2}]})
        n = 60
        for _ in range(n):  # fresh connections spread over both workers
            with httpx.Client(base_url=svc.url, timeout=5) as fresh:
                # The route reaches the other worker by a push a few ms after the PUT's
                # answer; until then its select is a 404, counted as "no_route".
                wait_until(lambda c=fresh: c.post("/select", json={"topic": "t"})
                           .raise_for_status().status_code == 200, 15, "the route on this worker")
                fresh.post("/report-latency", json={"brokerName": "x", "latencyMs": 1})
        for _ in range(6):  # whichever worker answers the scrape sees every worker's counts
            with httpx.Client(base_url=svc.url, timeout=5) as fresh:
                text = fresh.get("/metrics").text
            assert value(text, "detour_selects_total", decision="available") == n
            assert value(text, "detour_reports_total", broker="x", outcome="ok") == n
    finally:
        svc.stop()
    assert svc.proc.returncode == 0
    # Detour made it, so Detour removed it: a start leaves no directory behind.
    assert not list(tmp_path.glob("detour-metrics-*"))


@pytest.mark.integration
def test_isolation_windows_count_failures_by_reason_and_slow_answers_not(
    client: TestClient,
) -> None:
    """detour_isolation_windows_total, what DetourBrokerIsolated names: a failed send (also
    one extending its window), a quorum of failed sends; not a slow answer, not a quorum of
    slow answers, not a failure short of its quorum."""
    from tests.test_behaviour_policy import configure, metric

    def count(broker: str, reason: str) -> float:
        return metric(client, "detour_isolation_windows_total", broker=broker, reason=reason)

    def report(broker: str, latency: float, isolation: bool, producer: str) -> None:
        r = client.post("/report-latency", json={"brokerName": broker, "latencyMs": latency,
                                                 "isolation": isolation, "producer": producer})
        assert r.status_code == 200, r.text

    brokers = ("iso-fail", "iso-slow", "iso-quorum", "iso-slowq")
    before = {(b, r): count(b, r) for b in brokers for r in ("isolation", "quorum")}

    def added(broker: str, reason: str) -> float:
        return count(broker, reason) - before[(broker, reason)]

    # The first failure completed 50 ms ago (``ageMs``): the second's window ends later
    # whatever the clock reads between the two (in one millisecond, it would end at the
    # same moment and extend nothing).
    r = client.post("/report-latency:batch", json={"reports": [
        {"brokerName": "iso-fail", "latencyMs": 0, "isolation": True, "producer": "p1",
         "ageMs": 50}]})
    assert r.status_code == 200, r.text
    report("iso-fail", 0, True, "p2")  # extends the window: a failure again
    report("iso-slow", 600, False, "p1")
    assert added("iso-fail", "isolation") == 2
    assert added("iso-slow", "isolation") == added("iso-slow", "quorum") == 0

    configure(client, isolationQuorum=2, latencyQuorum=2)
    report("iso-quorum", 0, True, "p1")  # short of the quorum: only p1 avoids it
    assert added("iso-quorum", "quorum") == added("iso-quorum", "isolation") == 0
    report("iso-quorum", 0, True, "p2")
    assert added("iso-quorum", "quorum") == 1
    report("iso-slowq", 600, False, "p1")
    report("iso-slowq", 600, False, "p2")  # a quorum of slow answers: a latency window
    assert metric(client, "detour_window_events_total", kind="quorum", reason="quorum") >= 2
    assert added("iso-slowq", "quorum") == added("iso-slowq", "isolation") == 0
