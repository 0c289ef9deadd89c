"""The SDK's HTTP rules against a real Detour, through a real socket front where the case
needs an answer Detour would not give (a 5xx, a hang-up).

What is sent (paths, token, bodies, batch sizes) is read off the wire by
``tests.faulty.FaultyFront`` relaying to a Detour process that checks tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator

import pytest

from detour.client import (
    AsyncDetourClient,
    Decision,
    DetourClient,
    DetourUnavailable,
    Report,
)
from tests.faulty import FaultyFront, answer, hang_up, two_broker_topic
from tests.procs import ServiceProcess, free_port, write_tokens

pytestmark = pytest.mark.e2e

# Clients get a 2 s timeout: none of these tests is about the timeout, and a busy machine
# can miss the default 200 ms.

ADMIN, PRODUCER = "admin-secret-token-1", "producer-secret-token-1"
_topics = itertools.count(1)


@pytest.fixture(scope="module")
def detour(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """Detour checking tokens: the client's must reach it on every call."""
    tokens = write_tokens(tmp_path_factory.mktemp("auth") / "tokens.json", {
        "ops": (ADMIN, "admin", "default"), "app": (PRODUCER, "producer", "default")})
    with ServiceProcess(env={"DETOUR_TOKENS_FILE": str(tokens)}) as svc:
        yield svc


@pytest.fixture
def front(detour: ServiceProcess) -> Iterator[FaultyFront]:
    with FaultyFront(detour.url) as f:
        yield f


@pytest.fixture
def topic(detour: ServiceProcess) -> str:
    return two_broker_topic(detour.url, f"http{next(_topics)}", token=ADMIN)


def bodies(front: FaultyFront, path: str) -> list[dict[str, object]]:
    return [json.loads(r.body) for r in front.requests if r.path == path]


def test_remote_select_sends_the_token_and_fetches_route_and_config_once(
    front: FaultyFront, topic: str
) -> None:
    with DetourClient(front.url, decide_within=None, token=PRODUCER, timeout=2.0) as c:
        sel = c.select(topic, f"{topic}-a")
        c.select(topic)
    assert not sel.local and sel.decision is Decision.AVAILABLE
    assert sel.broker_name == f"{topic}-b"  # an available broker other than the last one
    # The route first: the select's answer is followed only if the route agrees with it.
    assert front.paths() == [f"/routes/{topic}", "/select", "/config", "/select"]
    assert all(r.headers["authorization"] == f"Bearer {PRODUCER}" for r in front.requests)
    assert bodies(front, "/select")[0] == {"topic": topic, "lastBrokerName": f"{topic}-a"}


@pytest.mark.parametrize("status", [500, 502, 503, 429])
def test_5xx_and_load_shedding_fail_open_then_the_circuit_opens(
    status: int, front: FaultyFront, topic: str
) -> None:
    error = json.dumps({"error": "STORE_UNAVAILABLE", "message": "", "field": None}).encode()
    with DetourClient(front.url, decide_within=None, token=PRODUCER, timeout=2.0) as c:
        c.select(topic)  # learns the route
        front.misbehave(lambda r: answer(status, error, {"content-type": "application/json"}))
        before = len(front.requests)
        first = c.select(topic)
        assert first.local and len(front.requests) == before + 1
        for _ in range(20):  # the circuit is open: no call at all
            assert c.select(topic, f"{topic}-b").local
        c.report(f"{topic}-a", 12, isolation=True)
        assert len(front.requests) == before + 1
        stats = c.stats()
        assert (stats.local_selects, stats.detour_failures, stats.pending_reports) == (21, 1, 1)
        assert stats.bad_answers == 0 and stats.rejected_calls == 0
        # The local table saw the report at once: a is avoided.
        assert c.select(topic).broker_name == f"{topic}-b"
        c.close(flush_timeout=0)  # Detour still down: the report is counted, not kept
        assert c.stats().dropped_reports == 1


def test_report_batch_is_split_by_a_thousand(front: FaultyFront, topic: str) -> None:
    with DetourClient(front.url, decide_within=None, token=PRODUCER, timeout=2.0) as c:
        t0 = time.monotonic()
        c.report_batch(Report(f"{topic}-b{i % 7}", i % 100, age_ms=i) for i in range(2500))
        took_ms = (time.monotonic() - t0) * 1000
        with pytest.raises(ValueError):
            c.report_batch([Report("ok", 1), Report("not ok", 1)])
        assert c.stats().sent_reports == 2500
    sent = bodies(front, "/report-latency:batch")
    assert [len(b["reports"]) for b in sent] == [1000, 1000, 500]  # type: ignore[arg-type]
    fourth = sent[0]["reports"][3]  # type: ignore[index]
    assert fourth | {"ageMs": 0, "reportId": ""} == {"brokerName": f"{topic}-b3",
                                                     "latencyMs": 3, "isolation": False,
                                                     "ageMs": 0, "reportId": ""}
    assert len({r["reportId"] for b in sent for r in b["reports"]}) == 2500  # type: ignore[index]
    # its age, plus the time until it left (at most the call's own duration)
    assert 3 <= fourth["ageMs"] <= 3 + took_ms + 1


def test_no_route_and_no_detour_is_a_clear_error() -> None:
    # Nothing listens there.
    with DetourClient(f"http://127.0.0.1:{free_port()}", decide_within=None) as c:
        with pytest.raises(DetourUnavailable, match="no route is known for topic 't'"):
            c.select("t")


def test_the_async_client_fails_open_the_same_way(front: FaultyFront, topic: str) -> None:
    async def main() -> None:
        async with AsyncDetourClient(front.url, decide_within=None, token=PRODUCER,
                                     timeout=2.0) as c:
            assert not (await c.select(topic)).local
            front.misbehave(lambda r: hang_up())
            assert (await c.select(topic)).local
            await c.report(f"{topic}-a", 1, isolation=True)
            assert c.stats().pending_reports == 1
            front.misbehave(None)
            assert await c.flush(5.0)  # waits out the open circuit, then sends
            assert c.stats().sent_reports == 1

    asyncio.run(main())
    (batch,) = bodies(front, "/report-latency:batch")
    assert batch["reports"][0]["isolation"] is True  # type: ignore[index]


def test_reports_carry_the_producer_id(front: FaultyFront, topic: str) -> None:
    with DetourClient(front.url, decide_within=None, token=PRODUCER, timeout=2.0,
                      producer="host-1/exec-2/p3") as client:
        client.report(f"{topic}-a", 3)
        assert client.stats().sent_reports == 1  # Detour took it
    (body,) = bodies(front, "/report-latency")
    assert body | {"reportId": ""} == {
        "brokerName": f"{topic}-a", "latencyMs": 3, "isolation": False,
        "producer": "host-1/exec-2/p3", "reportId": ""}
    with pytest.raises(ValueError, match="producer"):
        DetourClient(front.url, decide_within=None, producer="no spaces")


