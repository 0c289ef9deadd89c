"""Report ids on both stores: a report sent again is answered as the first time and says so,
changes nothing and starts no merge; ids are scoped by token, so no other token can claim
or push one out; an id reused with other content is refused and changes nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.app import create_app
from service.settings import Settings
from service.store import ids as ids_module
from service.store import redis as redis_store
from tests.asgi_client import TestClient
from tests.procs import PATIENT_CALL_TIMEOUT_S, write_tokens

pytestmark = pytest.mark.integration

TOKENS = {"alpha": ("tok-alpha", "producer", "default"),
          "beta": ("tok-beta", "producer", "default"),
          "admin": ("tok-admin", "admin", "default")}


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name][0]}"}


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    return write_tokens(tmp_path / "tokens.json", TOKENS)


def tokened_client(store_kind: str, tokens_file: Path, request: pytest.FixtureRequest
                   ) -> Iterator[TestClient]:
    fields: dict[str, Any] = {"tokens_file": str(tokens_file)}
    if store_kind == "redis":
        fields |= {"redis_url": request.getfixturevalue("redis_url"),
                   "redis_call_timeout_s": PATIENT_CALL_TIMEOUT_S}
    with TestClient(create_app(Settings(**fields))) as c:
        yield c


@pytest.fixture
def tokened(store_kind: str, tokens_file: Path, request: pytest.FixtureRequest
            ) -> Iterator[TestClient]:
    yield from tokened_client(store_kind, tokens_file, request)


def merges(c: TestClient) -> float:
    text = c.get("/metrics", headers=auth("admin")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("detour_store_reseeds_total{"))


def isolation(broker: str, rid: str, **extra: Any) -> dict[str, Any]:
    return {"brokerName": broker, "latencyMs": 5, "isolation": True, "reportId": rid, **extra}


def test_a_report_sent_again_is_answered_as_the_first_and_starts_no_merge(
        tokened: TestClient) -> None:
    first = tokened.post("/report-latency", json=isolation("a", "r-1"), headers=auth("alpha"))
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["duplicate"] is False and body["notAvailableDurationMs"] == 600_000
    before = merges(tokened)
    for _ in range(20):
        again = tokened.post("/report-latency", json=isolation("a", "r-1"), headers=auth("alpha"))
        assert again.status_code == 200
        assert again.json() == {**body, "duplicate": True}
    # the same id inside a batch, replayed with its age (the SDK's replay): the same answer
    batch = tokened.post("/report-latency:batch", headers=auth("alpha"),
                         json={"reports": [isolation("a", "r-1", ageMs=300)]})
    assert batch.status_code == 200
    (out,) = batch.json()["results"]
    assert out["duplicate"] is True and out["availableAt"] == body["availableAt"]
    assert merges(tokened) == before
    items = tokened.get("/fault-items", headers=auth("admin")).json()["items"]
    assert [i["availableAt"] for i in items if i["brokerName"] == "a"] == [body["availableAt"]]
    log = tokened.get("/latency-log", headers=auth("admin")).json()["entries"]
    assert [e["brokerName"] for e in log].count("a") == 1


def test_another_token_reusing_an_id_is_its_own_report(tokened: TestClient) -> None:
    """The id names alpha's report; beta's report with that id, for another broker, is
    beta's own: applied, its isolation kept (not dropped as a duplicate)."""
    a = tokened.post("/report-latency", json=isolation("a", "shared"), headers=auth("alpha"))
    b = tokened.post("/report-latency", json=isolation("b", "shared"), headers=auth("beta"))
    assert a.status_code == b.status_code == 200
    assert b.json()["duplicate"] is False
    assert b.json()["notAvailableDurationMs"] == 600_000
    items = {i["brokerName"]: i for i in
             tokened.get("/fault-items", headers=auth("admin")).json()["items"]}
    assert items["b"]["available"] is False and items["a"]["available"] is False


@pytest.mark.parametrize("path", ["/report-latency", "/report-latency:batch"])
def test_an_id_reused_with_other_content_is_refused_and_changes_nothing(
        tokened: TestClient, path: str) -> None:
    assert tokened.post("/report-latency", json=isolation("a", "r-7"),
                        headers=auth("alpha")).status_code == 200
    table = tokened.get("/fault-items", headers=auth("admin")).json()["items"]
    other = isolation("b", "r-7")
    body: dict[str, Any] = other if path == "/report-latency" else {
        "reports": [isolation("c", "r-8"), other]}
    r = tokened.post(path, json=body, headers=auth("alpha"))
    assert r.status_code == 422, r.text
    assert r.json()["error"] == "REPORT_ID_REUSED"
    assert r.json()["field"] == ("reportId" if path == "/report-latency"
                                 else "reports[1].reportId")
    # nothing of the request was applied, not even the batch's first report
    assert tokened.get("/fault-items", headers=auth("admin")).json()["items"] == table
    # the same id twice in one batch with different content: refused too
    r = tokened.post("/report-latency:batch", headers=auth("alpha"), json={
        "reports": [isolation("d", "r-9"), isolation("e", "r-9")]})
    assert r.status_code == 422 and r.json()["field"] == "reports[1].reportId"


def test_a_batch_applied_in_chunks_names_the_reused_item_and_keeps_its_word(
        tokened: TestClient) -> None:
    """A batch is applied in chunks of 25: an id repeated with other content within it is
    refused before any chunk is applied; one the store knew from an earlier request is
    refused in its chunk, with the earlier chunks applied (as documented), and either way
    ``field`` names the item in the batch, not in its chunk."""
    from service.api.reports import BATCH_CHUNK

    def broker_names() -> set[str]:
        items = tokened.get("/fault-items", headers=auth("admin")).json()["items"]
        return {i["brokerName"] for i in items}

    size = 2 * BATCH_CHUNK + 10
    late = 2 * BATCH_CHUNK + 5
    within = [isolation(f"w{i}", f"w-{i}") for i in range(size)]
    within[late] = isolation("w-late", "w-3")  # item 3's id, other content
    r = tokened.post("/report-latency:batch", headers=auth("alpha"), json={"reports": within})
    assert r.status_code == 422, r.text
    assert (r.json()["error"], r.json()["field"]) == ("REPORT_ID_REUSED",
                                                      f"reports[{late}].reportId")
    assert broker_names() == set()  # nothing of it applied

    assert tokened.post("/report-latency", json=isolation("known", "k-1"),
                        headers=auth("alpha")).status_code == 200
    stored = [isolation(f"s{i}", f"s-{i}") for i in range(size)]
    stored[late] = isolation("s-late", "k-1")  # the stored id, other content
    r = tokened.post("/report-latency:batch", headers=auth("alpha"), json={"reports": stored})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == f"reports[{late}].reportId"
    # The answer says what was applied: the chunks before the refused item's.
    before = late // BATCH_CHUNK * BATCH_CHUNK
    assert f"reports[0] to reports[{before - 1}] were applied" in r.json()["message"]
    before = late // BATCH_CHUNK * BATCH_CHUNK
    assert broker_names() == {"known"} | {f"s{i}" for i in range(before)}


def test_another_tokens_flood_of_ids_never_pushes_one_out(
        store_kind: str, tokens_file: Path, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a scope cap of 20 ids: beta's 100 ids leave alpha's one where it is (its replay
    is still a duplicate)."""
    monkeypatch.setattr(redis_store, "REPORT_ID_CAP", 20)
    monkeypatch.setattr(ids_module, "REPORT_ID_CAP", 20)
    # built after the cap is set (a store reads it when it starts)
    for tokened in tokened_client(store_kind, tokens_file, request):
        _flood(tokened)


def _flood(tokened: TestClient) -> None:
    first = tokened.post("/report-latency", json=isolation("a", "keep"), headers=auth("alpha"))
    assert first.status_code == 200
    for start in range(0, 100, 25):
        r = tokened.post("/report-latency:batch", headers=auth("beta"), json={"reports": [
            isolation(f"x{i}", f"flood-{i}") for i in range(start, start + 25)]})
        assert r.status_code == 200, r.text
    again = tokened.post("/report-latency", json=isolation("a", "keep"), headers=auth("alpha"))
    assert again.json()["duplicate"] is True
    assert again.json()["availableAt"] == first.json()["availableAt"]


def test_ids_are_bounded_per_scope(store_kind: str, request: pytest.FixtureRequest,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """However many ids a scope sends, it keeps at most the cap of them."""
    monkeypatch.setattr(redis_store, "REPORT_ID_CAP", 30)
    monkeypatch.setattr(ids_module, "REPORT_ID_CAP", 30)
    fields: dict[str, Any] = {}
    if store_kind == "redis":
        fields |= {"redis_url": request.getfixturevalue("redis_url"),
                   "redis_call_timeout_s": PATIENT_CALL_TIMEOUT_S, "report_flush_ms": 0}
    with TestClient(create_app(Settings(**fields))) as c:
        sent = time.monotonic()
        for start in range(0, 200, 50):
            r = c.post("/report-latency:batch", json={"reports": [
                isolation(f"y{i}", f"id-{i}") for i in range(start, start + 50)]})
            assert r.status_code == 200, r.text
        # the newest are remembered, the oldest went: only the open scope's own traffic
        assert c.post("/report-latency", json=isolation("y199", "id-199")).json()["duplicate"]
        # A forgotten id is not taken for new: replayed with its age (as the SDK replays),
        # it is answered expired, not applied a second time.
        age_ms = int((time.monotonic() - sent) * 1000)
        replay = c.post("/report-latency:batch", json={"reports": [
            isolation("y0", "id-0", ageMs=age_ms)]}).json()["results"][0]
        assert not replay["duplicate"] and replay["expired"], replay
        if store_kind == "redis":
            import redis as redis_client

            raw = redis_client.Redis.from_url(fields["redis_url"], decode_responses=True)
            assert raw.hlen("detour:{default}:ids") <= 30
            assert raw.zcard("detour:{default}:ids-index") <= 30
            raw.close()
        else:
            assert len(c.app_state["store"]._ids) <= 30


def test_a_retry_while_redis_is_away_is_answered_as_the_first_and_journaled_once() -> None:
    """While Redis is away a replica answers from its journal: a retry of a report it sent
    to Redis before, or journaled already, or repeated in the same call, is answered as the
    first time and is neither applied nor journaled again; an id reused with other content
    is still refused. (The class of the replayed-id bug: every way a report reaches a
    replica twice while it cannot ask Redis.)"""
    import asyncio

    from service.errors import ReportIdReused
    from service.store import ReportIn
    from service.store.redis import RedisStore
    from tests.procs import RedisServer

    server = RedisServer()

    async def scenario() -> None:
        settings = Settings(redis_url=server.url, report_flush_ms=60_000, sync_interval_s=60)
        store = RedisStore(settings)
        await store.start()
        try:
            (sent,) = await store.report_many([ReportIn("x", 0, True, report_id="r-1")])
            assert not sent.duplicate and not sent.degraded
            server.proc.kill()
            server.proc.wait(10)

            (again,) = await store.report_many([ReportIn("x", 0, True, report_id="r-1")])
            assert again.duplicate and again.available_at == sent.available_at
            assert len(store._journal) == 0

            a, b = await store.report_many(
                [ReportIn("y", 0, True, report_id="r-2"), ReportIn("y", 0, True, report_id="r-2")]
            )
            assert a.degraded and not a.duplicate and b.duplicate
            (c,) = await store.report_many([ReportIn("y", 0, True, report_id="r-2")])
            assert c.duplicate and c.available_at == a.available_at
            assert len(store._journal) == 1

            with pytest.raises(ReportIdReused):
                reused = ReportIn("y", 7, True, report_id="r-2")
                await store.report_many([ReportIn("z", 0, True, report_id="r-3"), reused])
            assert len(store._journal) == 1 and "z" not in store.view.faults
        finally:
            await store.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_replay_after_its_id_was_pushed_out_is_expired_and_changes_nothing(
        store_kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
        ) -> None:
    """A producer's report applied, its reply lost; 100 other reports of its scope push its
    id out of a 30-id memory; its replay (same id and content, in a batch with its age, as
    the SDK replays) was applied a second time. Now it is answered ``expired``: the window,
    the item and the event log are as they were. Reports without an id are applied as
    always."""
    monkeypatch.setattr(redis_store, "REPORT_ID_CAP", 30)
    monkeypatch.setattr(ids_module, "REPORT_ID_CAP", 30)
    fields: dict[str, Any] = {"events_max": 1000}
    if store_kind == "redis":
        fields |= {"redis_url": request.getfixturevalue("redis_url"),
                   "redis_call_timeout_s": PATIENT_CALL_TIMEOUT_S, "report_flush_ms": 0}
    with TestClient(create_app(Settings(**fields))) as c:
        sent = time.monotonic()
        first = c.post("/report-latency", json=isolation("victim", "lost-reply"))
        assert first.status_code == 200, first.text
        for start in range(0, 100, 50):
            r = c.post("/report-latency:batch", json={"reports": [
                isolation(f"z{i}", f"other-{i}") for i in range(start, start + 50)]})
            assert r.status_code == 200, r.text
        item_before = [i for i in c.get("/fault-items").json()["items"]
                       if i["brokerName"] == "victim"]
        events_before = c.get("/events", params={"limit": 1000}).json()
        age_ms = int((time.monotonic() - sent) * 1000)  # since the send completed
        replay = c.post("/report-latency:batch", json={"reports": [
            isolation("victim", "lost-reply", ageMs=age_ms)]}).json()["results"][0]
        assert replay["expired"] and not replay["duplicate"], replay
        assert replay["availableAt"] == first.json()["availableAt"]
        assert [i for i in c.get("/fault-items").json()["items"]
                if i["brokerName"] == "victim"] == item_before
        assert c.get("/events", params={"limit": 1000}).json() == events_before
        text = c.get("/metrics").text
        assert any(line.startswith("detour_reports_expired_total ") and
                   float(line.split()[-1]) >= 1 for line in text.splitlines())
        plain = c.post("/report-latency", json={"brokerName": "victim", "latencyMs": 5,
                                                 "isolation": True}).json()
        assert not plain["expired"]


# -- The horizon, on ReportIds alone, on an injected clock (service/store/ids.py) ---------


def _report(rid: str, at_ms: int, scope: str = "") -> Any:
    from detour.apply import ReportIn

    return ReportIn("b", 5, True, report_id=rid, scope=scope, at_ms=at_ms)


def _answer(now: int) -> Any:
    from service.store.base import ReportOutcome

    return ReportOutcome("b", 5, 0, now, now)


def test_the_horizon_is_the_window_and_what_the_cap_pushed_out() -> None:
    from detour.model import REPORT_ID_MARGIN_MS as MARGIN
    from service.store.ids import ReportIds

    ids = ReportIds(window_ms=60_000, cap=3)
    t0 = 1_000_000
    assert ids.horizon("", t0) == t0 - 60_000 + MARGIN  # nothing pushed out: the window
    for k in range(4):  # the fourth pushes the first (seen at t0) out
        ids.remember(_report(f"id-{k}", t0 + k), _answer(t0 + k), t0 + k)
    later = t0 + 60_000
    # The margin after the newest pushed out id is at most half the time since it.
    assert ids.horizon("", t0 + 100) == t0 + 50
    assert ids.horizon("", later) == max(later - 60_000 + MARGIN, t0 + min(MARGIN, 30_000))
    # Another scope is untouched by this one's cap.
    assert ids.horizon("other", later) == later - 60_000 + MARGIN
    # The forgotten id, replayed with its date: expired. A fresh one dated now: applied.
    done = ids.sort([_report("id-0", t0), _report("new", later)], later, lambda b: 7)
    assert done.expired == 1 and done.out[0] is not None and done.out[0].expired
    assert done.out[0].available_at == 7 and not done.out[0].duplicate
    assert [i for i, _ in done.fresh] == [1] and done.duplicates == 0
    # A remembered one is still a duplicate, whatever its date.
    again = ids.sort([_report("id-3", t0)], later, lambda b: 7)
    assert again.duplicates == 1 and again.expired == 0


def test_a_scope_pushing_ids_out_fast_still_has_its_fresh_reports_taken() -> None:
    """A memory that spans only milliseconds (ids pushed out as fast as they come) must not
    take every fresh report for a forgotten one: the margin shrinks with it."""
    from service.store.ids import ReportIds

    ids = ReportIds(window_ms=900_000, cap=10)
    now = 5_000_000
    for k in range(1000):
        now += 1
        done = ids.sort([_report(f"r{k}", now)], now, lambda b: 0)
        assert done.expired == 0, k
        ids.settle(done, [_answer(now)], now)
    assert len(ids) <= 10
