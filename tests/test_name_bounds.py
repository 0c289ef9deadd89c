"""Names a client chooses (brokers, topics, report ids) never grow what a replica holds past
its bounds, on both stores.

Instead of watching the process's RSS (slow, and noisy on a busy machine), the test feeds
tens of thousands of new names through the app and then walks every container reachable
from the store and its view (dicts, sets, lists, deques, to a few levels deep): none may
hold more than the largest bound in play. A per-name map that somebody forgets to bound
shows up here by its size, whatever it is called.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest

from service.app import create_app
from service.settings import Settings
from tests.asgi_client import TestClient
from tests.procs import PATIENT_CALL_TIMEOUT_S

pytestmark = pytest.mark.integration

#: The caps this test sets: the table's, the topic counters', the per-broker series'.
MAX_BROKERS = 500
MAX_TOPICS = 300
MAX_SERIES = 200
#: Names fed through the app: far past every cap.
NAMES = 6_000


def containers(obj: Any, path: str = "store", depth: int = 4,
               seen: set[int] | None = None) -> Iterator[tuple[str, int]]:
    """(path, size) of every container reachable from ``obj``'s attributes."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, dict | set | frozenset | list | tuple | deque):
        yield path, len(obj)
        if isinstance(obj, dict):
            for k, v in list(obj.items())[:20]:
                yield from containers(v, f"{path}[{k!r}]", depth - 1, seen)
        return
    if isinstance(obj, str | bytes | int | float | bool) or obj is None:
        return
    module = type(obj).__module__
    if not module.startswith(("service", "detour")):
        return  # library objects (clients, pools, locks) are not Detour's per-name state
    attrs = getattr(obj, "__dict__", {})
    slots = [s for cls in type(obj).__mro__ for s in getattr(cls, "__slots__", ())]
    for name in [*attrs, *slots]:
        if hasattr(obj, name):
            yield from containers(getattr(obj, name), f"{path}.{name}", depth - 1, seen)


@pytest.fixture
def app(store_kind: str, request: pytest.FixtureRequest) -> Iterator[TestClient]:
    fields: dict[str, Any] = {"max_brokers": MAX_BROKERS, "max_topic_counters": MAX_TOPICS,
                              "metrics_max_brokers": MAX_SERIES, "latency_log_max": 100,
                              "events_max": 100}
    if store_kind == "redis":
        fields |= {"redis_url": request.getfixturevalue("redis_url"),
                   "redis_call_timeout_s": PATIENT_CALL_TIMEOUT_S}
    with TestClient(create_app(Settings(**fields))) as c:
        yield c


def test_new_names_never_grow_a_replica_past_its_bounds(app: TestClient) -> None:
    # brokers: fast reports (ended windows, evicted at the cap), with report ids
    for start in range(0, NAMES, 500):
        r = app.post("/report-latency:batch", json={"reports": [
            {"brokerName": f"b-{i}", "latencyMs": 0, "reportId": f"id-{i}"}
            for i in range(start, start + 500)]})
        assert r.status_code in (200, 409), r.text
    # topics: inline selects, each a new topic counter
    for i in range(NAMES // 4):
        r = app.post("/select", json={"topic": f"inline-{i}", "queues": [
            {"brokerName": "x", "queueId": 0}, {"brokerName": "y", "queueId": 1}]})
        assert r.status_code == 200
    # routes written and deleted: graves, tombstones
    for i in range(MAX_TOPICS * 2):
        body = {"brokers": [{"brokerName": "x", "writeQueueNums": 1}]}
        assert app.put(f"/routes/r-{i}", json=body).status_code == 200
        assert app.delete(f"/routes/r-{i}").status_code == 204
    scrape = app.get("/metrics").text
    store = app.app_state["store"]
    sizes = dict(containers(store))
    assert any(path.startswith("store.view") for path in sizes)  # the walk reached the view
    # the largest bound in play: the report ids a scope keeps (100,000) are above NAMES, so
    # they are held to what was sent; everything else to its own cap
    too_big = {p: n for p, n in sizes.items()
               if n > max(MAX_BROKERS, MAX_TOPICS, MAX_SERIES) * 2 and "ids._scopes" not in p}
    assert not too_big, too_big
    assert len(store.view.faults) <= MAX_BROKERS
    # per metric family, at most the cap of this test's brokers (and "_other"); the registry
    # is the process's, so series that tests before this one created (in the same worker)
    # are not counted: only the names this test invented
    brokers: dict[str, set[str]] = {}
    for line in scrape.splitlines():
        if 'broker="' in line and not line.startswith("#"):
            family = line.split("{", 1)[0].removesuffix("_bucket").removesuffix("_count")
            name = line.split('broker="', 1)[1].split('"', 1)[0]
            if name.startswith("b-") or name == "_other":
                brokers.setdefault(family.removesuffix("_sum"), set()).add(name)
    assert brokers and max(len(b) for b in brokers.values()) <= MAX_SERIES + 1, {
        f: len(b) for f, b in brokers.items()}
    assert any("_other" in b for b in brokers.values())  # the flood did reach the cap
