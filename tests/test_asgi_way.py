"""The ASGI way into /select and /report-latency (plain FastAPI routes, what the direct
lane declines and what ``DETOUR_DIRECT_LANE=false`` serves): the answers, and the
request-timer series each is counted under."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.settings import Settings
from tests.test_metrics import value

pytestmark = pytest.mark.integration

ROUTE = {"brokers": [{"brokerName": "a", "writeQueueNums": 2}]}


@pytest.fixture()
def app_client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(max_body_bytes=1024))) as c:
        c.put("/routes/t", json=ROUTE).raise_for_status()
        yield c


def timed(c: TestClient, route: str, status: str) -> float:
    text = c.get("/metrics").text
    return value(text, "detour_http_request_duration_seconds_count", route=route,
                 method="POST", status=status)


def test_each_answer_is_timed_under_the_series_the_chain_used(app_client: TestClient) -> None:
    c = app_client
    before = {(r, s): timed(c, r, s) for r, s in [("/select", "200"), ("/select", "404"),
                                                 ("/select", "422"), ("/select", "413"),
                                                 ("unmatched", "415")]}
    assert c.post("/select", json={"topic": "t"}).status_code == 200
    assert c.post("/select", json={"topic": "nope"}).json()["error"] == "NOT_FOUND"
    bad = c.post("/select", json={"topic": 5})
    assert bad.status_code == 422 and bad.json()["field"] == "topic"
    dup = c.post("/select", content=b'{"topic":"t","topic":"u"}',
                 headers={"content-type": "application/json"})
    assert dup.status_code == 422 and dup.json()["field"] == "topic"
    # Not JSON: 415, timed before the router matched (as the JSON check ran before it).
    assert c.post("/select", content=b"topic=t",
                  headers={"content-type": "text/plain"}).status_code == 415
    # Over the limit by Content-Length: 413 before the timer, so not timed.
    big = c.post("/select", content=b'{"topic":"' + b"t" * 2000 + b'"}',
                 headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["field"] == "body"
    # Over the limit while streaming (no Content-Length): 413 from the handler, timed.
    chunks = iter([b'{"topic":"', b"t" * 2000, b'"}'])
    streamed = c.post("/select", content=chunks, headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    after = {k: timed(c, *k) for k in before}
    assert {k: after[k] - before[k] for k in before} == {
        ("/select", "200"): 1, ("/select", "404"): 1, ("/select", "422"): 2,
        ("/select", "413"): 1, ("unmatched", "415"): 1,
    }


def test_other_methods_and_paths_pass_on_to_the_router(app_client: TestClient) -> None:
    r = app_client.get("/select")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    slash = app_client.post("/select/", json={"topic": "t"}, follow_redirects=False)
    assert slash.status_code == 404  # no such path (no redirect), as without the lane
    report = app_client.post("/report-latency", json={"brokerName": "a", "latencyMs": 7})
    assert report.status_code == 200 and report.json()["notAvailableDurationMs"] == 0
