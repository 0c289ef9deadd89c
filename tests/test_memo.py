"""Kept answers (detour.memo, detour.selector.choose_kept, detour.policy.steady): a select
answered from them is the select ``choose_on`` makes on the same table, for every config,
in the SDK's table copy and in the service's view alike."""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detour import selector
from detour.client import wire
from detour.client.local import LocalTable
from detour.decide import Ask
from detour.memo import Memos
from detour.model import Config, FaultItem, Route
from detour.policy import Choice
from detour.policy.steady import FOREVER, steady
from detour.profiles import RECOMMENDED, ROCKETMQ_4
from detour.view import Snapshot, TableView
from service.api.select import Rendered, rendered
from service.selector import choose_rendered
from tests.budget import examples

NOW = 1_700_000_000_000
BROKERS = ("a", "b", "c", "d")
PRODUCERS = ("p1", "p2")

configs = st.builds(
    Config,
    send_latency_fault_enable=st.booleans(),
    selection=st.sampled_from(["round_robin", "round_robin", "p2c-ewma"]),
    max_avoided_percent=st.sampled_from([100, 100, 0, 34, 50, 75]),
    panic_threshold_percent=st.sampled_from([0, 0, 25, 50, 100]),
    enforcement_percent=st.sampled_from([100, 100, 0, 50]),
    isolation_quorum=st.integers(1, 3),
    latency_quorum=st.integers(1, 3),
    probe_on_expiry=st.booleans(),
    probe_timeout_ms=st.sampled_from([1, 500, 10_000]),
    early_recovery=st.booleans(),
    ramp_ms=st.sampled_from([0, 0, 600, 3000]),
    detector_enable=st.booleans(),
    pending_quorum=st.integers(0, 2),
)


def route_of(counts: list[int]) -> Route:
    return wire.route(
        {
            "topic": "t",
            "brokers": [
                {"brokerName": b, "writeQueueNums": n, "address": f"10.0.0.{i}:10911"}
                for i, (b, n) in enumerate(zip(BROKERS, counts, strict=False))
            ],
        }
    )


routes = st.lists(st.integers(1, 4), min_size=1, max_size=len(BROKERS)).map(route_of)
offsets = st.integers(-4000, 4000)
#: Selects in a row at one clock reading: up to two laps of the largest route, so that
#: kept answers are read back, after a change too.
LAPS = st.integers(1, 2 * 4 * len(BROKERS))


@st.composite
def items(draw: st.DrawFn, broker: str) -> FaultItem:
    return FaultItem(
        broker,
        draw(st.sampled_from([0, 20, 700, 3000])),
        draw(st.sampled_from([0, NOW + draw(offsets)])),
        suspects=tuple((p, NOW + draw(offsets)) for p in draw(st.sets(st.sampled_from(PRODUCERS)))),
        probation=draw(st.booleans()),
        reachable=draw(st.sampled_from([None, True, False])),
        slow=tuple(
            (p, NOW + draw(offsets), NOW + draw(offsets))
            for p in draw(st.sets(st.sampled_from(PRODUCERS)))
        ),
    )


@st.composite
def tables(draw: st.DrawFn) -> dict[str, FaultItem]:
    present = draw(st.sets(st.sampled_from(BROKERS + ("x",))))
    return {b: draw(items(b)) for b in sorted(present)}


#: One step of a run: move the clock and select (afresh, or again from the last select's start),
#: change an item, only its window end, or only its latency (which no select reads), drop
#: it, jump the counter.
steps = st.one_of(
    st.tuples(st.just("select"), st.sampled_from([0, 0, 1, 250, 1000, 3000])),
    st.tuples(st.just("again"), st.sampled_from([0, 0, 1, 250, 1000, 3000])),
    st.tuples(st.just("item"), st.sampled_from(BROKERS)),
    st.tuples(st.just("move"), st.sampled_from(BROKERS)),
    st.tuples(st.just("latency"), st.sampled_from(BROKERS)),
    st.tuples(st.just("drop"), st.sampled_from(BROKERS)),
    st.tuples(st.just("counter"), st.integers(0, 1 << 31)),
)


def pair(
    config: Config,
    route: Route,
    faults: dict[str, FaultItem],
    producer: str | None,
    clock: list[int],
) -> tuple[LocalTable, LocalTable]:
    tables = []
    for _ in range(2):
        t = LocalTable(lambda: clock[0], producer)
        t.replace(config, [route], faults)
        t.view.set_counter("t", 0)
        tables.append(t)
    return tables[0], tables[1]


@pytest.mark.unit
@given(
    config=configs,
    route=routes,
    faults=tables(),
    producer=st.sampled_from([None, "p1"]),
    run=st.lists(steps, min_size=8, max_size=40),
    data=st.data(),
)
@settings(max_examples=examples(), deadline=None)
def test_kept_answers_are_the_decisions_of_the_full_select(
    config: Config,
    route: Route,
    faults: dict[str, FaultItem],
    producer: str | None,
    run: list[tuple[str, Any]],
    data: st.DataObject,
) -> None:
    """Table ``kept`` answers first attempts from its memo where it may; table ``full`` decides
    every select with ``choose_on`` (an explicit generator bypasses the memo). Each select
    gets the same draws on both, so the answers and the counters must be the same."""
    clock = [NOW]
    kept, full = pair(config, route, faults, producer, clock)
    with pytest.MonkeyPatch.context() as monkeypatch:
        play(kept, full, clock, run, data, monkeypatch)


def changed(
    what: str, broker: str, old: FaultItem | None, data: st.DataObject
) -> FaultItem | None:
    """A step's new item for ``broker`` (None: dropped): a new one, ``old`` with only its
    window end moved, or with only its latency changed (which no select reads)."""
    if what == "item":
        return data.draw(items(broker))
    if what == "move" and old is not None:
        return replace(old, available_at=NOW + data.draw(offsets))
    if what == "latency" and old is not None:
        return replace(old, current_latency_ms=old.current_latency_ms + 1)
    return None


def play(
    kept: LocalTable,
    full: LocalTable,
    clock: list[int],
    run: list[tuple[str, Any]],
    data: st.DataObject,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = kept.view.counter("t")
    for i, (what, arg) in enumerate(run):
        if what in ("select", "again"):
            clock[0] += arg
            if what == "again":
                for t in (kept, full):
                    t.view.set_counter("t", before)
            before = kept.view.counter("t")
            for j in range(data.draw(LAPS)):  # up to two laps: kept answers get read
                monkeypatch.setattr(selector, "_rng", random.Random(100 * i + j))
                got = kept.select("t", None)
                want = full.select("t", None, rng=random.Random(100 * i + j))
                assert got == want
                assert kept.view.counter("t") == full.view.counter("t")
        elif what == "counter":
            for t in (kept, full):
                t.view.set_counter("t", arg)
        else:
            new = changed(what, arg, full.fault(arg), data)
            for t in (kept, full):
                t.set_fault(arg, new)


def bench_table(config: Config, producer: str | None = None) -> tuple[LocalTable, list[int]]:
    """The route of ``python -m bench.client``: 4 brokers x 8 queues, b isolated."""
    clock = [NOW]
    table = LocalTable(lambda: clock[0], producer)
    table.replace(config, [route_of([8, 8, 8, 8])], {"b": FaultItem("b", 30000, NOW + 600_000)})
    table.view.set_counter("t", 0)
    return table, clock


@pytest.mark.unit
@pytest.mark.parametrize("config", [ROCKETMQ_4, RECOMMENDED], ids=["rocketmq-4", "recommended"])
def test_a_second_lap_is_answered_from_the_memo(config: Config) -> None:
    table, _ = bench_table(config, "p1")
    first = [table.select("t", None) for _ in range(24)]
    second = [table.select("t", None) for _ in range(24)]

    assert all(a is b for a, b in zip(first, second, strict=True))
    assert {s.broker_name for s in first if s is not None} == {"a", "c", "d"}


@pytest.mark.unit
def test_a_report_that_changes_no_window_keeps_the_answers_one_that_opens_one_drops_them() -> None:
    table, _ = bench_table(RECOMMENDED, "p1")
    lap = [table.select("t", None) for _ in range(24)]

    table.apply_report("a", 3, False)  # a healthy answer: a new latency, no window
    assert [table.select("t", None) for _ in range(24)] == lap
    assert all(
        a is b for a, b in zip(lap, [table.select("t", None) for _ in range(24)], strict=True)
    )

    table.apply_report("c", 0, True)  # a failure: c's window opens
    after = [table.select("t", None) for _ in range(16)]
    assert {s.broker_name for s in after if s is not None} == {"a", "d"}


@pytest.mark.unit
def test_answers_change_when_a_window_ends() -> None:
    table, clock = bench_table(ROCKETMQ_4)
    assert "b" not in {s.broker_name for s in (table.select("t", None) for _ in range(24)) if s}

    clock[0] = NOW + 600_000  # b's window ends
    assert "b" in {s.broker_name for s in (table.select("t", None) for _ in range(32)) if s}


@pytest.mark.unit
def test_a_window_ended_by_the_stream_is_obeyed_at_once() -> None:
    """Only the window end changes (an operator's restore, pushed): the kept answers go."""
    table, _ = bench_table(RECOMMENDED)
    assert "b" not in {s.broker_name for s in (table.select("t", None) for _ in range(24)) if s}
    item = table.fault("b")
    assert item is not None

    table.set_fault("b", replace(item, available_at=0))
    assert "b" in {s.broker_name for s in (table.select("t", None) for _ in range(32)) if s}


@pytest.mark.unit
def test_nothing_is_kept_while_a_draw_or_a_probe_decides() -> None:
    route = route_of([2, 2])
    ramping = {"a": FaultItem("a", 0, NOW - 100)}
    probation = {"a": FaultItem("a", 0, NOW - 100, probation=True)}

    assert steady(route, ramping, NOW, Config(ramp_ms=3000), None).avoidance is None
    assert steady(route, ramping, NOW, Config(ramp_ms=3000), None).until == NOW + 2900
    assert steady(route, probation, NOW, Config(early_recovery=True), None).avoidance is None
    assert steady(route, {}, NOW, Config(selection="p2c-ewma"), None).avoidance is None
    assert steady(route, {}, NOW, Config(enforcement_percent=50), None).avoidance is None
    assert steady(route, ramping, NOW, ROCKETMQ_4, None).until == FOREVER
    own = {"a": FaultItem("a", 0, 0, slow=(("p1", NOW - 10, NOW + 700),))}
    mine = steady(route, own, NOW, Config(latency_quorum=2), "p1")
    assert mine.avoidance is not None and mine.avoidance.enforced == {"a"}
    assert mine.until == NOW + 700  # the producer's own window ends then


@pytest.mark.unit
def test_a_probe_is_handed_out_again_after_its_timeout() -> None:
    """probeTimeoutMs after a probe the next select probes again: no kept answer hides it."""
    config = Config(early_recovery=True, probe_timeout_ms=500)
    clock = [NOW]
    kept, full = pair(
        config, route_of([2, 2]), {"a": FaultItem("a", 0, NOW - 10, probation=True)}, None, clock
    )
    answers = []
    for dt, rewind in ((0, False), (0, False), (1000, True)):
        clock[0] += dt
        if rewind:
            for t in (kept, full):
                t.view.set_counter("t", 1)
        got, want = kept.select("t", None), full.select("t", None, rng=random.Random(0))
        assert got == want
        answers.append(got.probe if got else None)
    assert answers == [True, False, True]


@pytest.mark.unit
def test_concurrent_selects_share_the_counter() -> None:
    """Selects from many threads, kept answers or not, step one counter: an even share each."""
    table, _ = bench_table(RECOMMENDED, "p1")
    seen: Counter[tuple[str, int]] = Counter()
    lock = threading.Lock()

    def work() -> None:
        mine: Counter[tuple[str, int]] = Counter()
        for _ in range(2400):
            s = table.select("t", None)
            assert s is not None
            mine[s.broker_name, s.queue_id] += 1
        with lock:
            seen.update(mine)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert len(seen) == 24 and set(seen.values()) == {400}


# -- the service's view: POST /select keeps answers with the same rule ---------------------


def answer_of(choice: Choice) -> tuple[Any, ...]:
    """What a select answers (the queue, why, what it passed over, the avoidance), without
    the absolute counter a kept choice carries from when it was decided."""
    sel = choice.selection
    return (sel.queue, sel.decision, sel.avoided_brokers, choice.avoidance, choice.probe,
            choice.ordered)  # fmt: skip


def service_choose(view: TableView, topic: str, producer: str | None) -> Rendered:
    """The service's select (``service.selector``), rendered as ``/select`` renders it:
    its ``choice``, and the answer's text around ``degraded``."""
    return choose_rendered(view, topic, None, None, producer, None, rendered)[1]


def views(
    config: Config, route: Route, faults: dict[str, FaultItem], clock: list[int]
) -> list[TableView]:
    out = []
    for _ in range(2):
        v = TableView(lambda: clock[0])
        v.replace(Snapshot(version=1, config=config, config_version=1, routes={"t": route},
                           faults=dict(faults)))  # fmt: skip
        v.set_counter("t", 0)
        out.append(v)
    return out


@pytest.mark.unit
@given(
    config=configs,
    route=routes,
    faults=tables(),
    producer=st.sampled_from([None, "p1", "p2"]),
    run=st.lists(steps, min_size=8, max_size=40),
    data=st.data(),
)
@settings(max_examples=examples(), deadline=None)
def test_the_services_kept_answers_are_the_decisions_of_the_full_select(
    config: Config,
    route: Route,
    faults: dict[str, FaultItem],
    producer: str | None,
    run: list[tuple[str, Any]],
    data: st.DataObject,
) -> None:
    """View ``kept`` answers as ``POST /select`` does (``service.selector.choose``); view
    ``full`` decides every select with ``choose_on``. Changes come the ways a replica
    applies them: versioned pushes, items learnt from a report's reply, the replica's own
    windows while the store is away, and the config."""
    clock = [NOW]
    kept, full = views(config, route, faults, clock)
    version = [1]
    before = kept.counter("t")
    with pytest.MonkeyPatch.context() as monkeypatch:
        for i, (what, arg) in enumerate(run):
            if what in ("select", "again"):
                clock[0] += arg
                if what == "again":
                    for v in (kept, full):
                        v.set_counter("t", before)
                before = kept.counter("t")
                for j in range(data.draw(LAPS)):
                    monkeypatch.setattr(selector, "_rng", random.Random(100 * i + j))
                    got = service_choose(kept, "t", producer)
                    want = selector.choose_on(full, route, Ask(None, producer, None),
                                              random.Random(100 * i + j), clock[0])  # fmt: skip
                    assert answer_of(got.choice) == answer_of(want)
                    # The text kept with the choice is the full select's, rendered now.
                    assert got.text(False) == rendered(route, want).text(False)
                    assert kept.counter("t") == full.counter("t")
            elif what == "counter":
                for v in (kept, full):
                    v.set_counter("t", arg)
            else:
                new = changed(what, arg, full.faults.get(arg), data)
                how = data.draw(st.sampled_from(["push", "push", "learnt", "local"]))
                version[0] += 1
                for v in (kept, full):
                    if new is None:
                        v.apply_fault(arg, None, version[0])
                    elif how == "learnt":
                        v.learn_fault(new)
                    elif how == "local":
                        v.set_local_fault(new)
                    else:
                        v.apply_fault(arg, new, version[0])
            if data.draw(st.integers(0, 15)) == 0:  # now and then a new config
                version[0] += 1
                other = data.draw(configs)
                for v in (kept, full):
                    v.apply_config(other, version[0])


@pytest.mark.unit
def test_the_services_kept_answers_are_bounded_by_pairs_not_by_producer_names() -> None:
    """Every new producer name is a new (topic, producer) pair: past the cap the kept
    answers are dropped, never grown."""
    clock = [NOW]
    view, _ = views(RECOMMENDED, route_of([4, 4, 4, 4]), {}, clock)
    cap = view.memos.cap
    for n in range(3 * cap):
        service_choose(view, "t", f"producer-{n}")
        assert len(view.memos) <= cap
    assert len(view.memos) > 0


@pytest.mark.unit
def test_the_latest_memos_are_bounded_with_the_kept_ones() -> None:
    """``Memos.latest`` holds one of the kept memos per topic: a stream of new topic names
    never grows it past the kept ones, which the cap bounds."""
    memos: Memos[str] = Memos(cap=64)
    for n in range(3 * memos.cap):
        brokers = [{"brokerName": "a", "writeQueueNums": 1}]
        route = wire.route({"topic": f"t{n}", "brokers": brokers})
        memo = memos.renew(route, ROCKETMQ_4, {}, NOW, f"p{n % 3}", 7)
        assert memos.latest[route.topic] is memo
        assert len(memos.latest) <= len(memos) <= memos.cap
    assert len(memos.latest) > 0


@pytest.mark.unit
def test_a_memo_of_another_view_or_route_is_never_used() -> None:
    """Two routes of one topic name (another namespace's view, a route replaced) are other
    objects: the memo kept for one is never read for the other, whatever the epochs say."""
    memos: Memos[str] = Memos()
    a, b = route_of([2, 2]), route_of([1, 1, 1])
    first = memos.renew(a, ROCKETMQ_4, {}, NOW, None, 7)
    second = memos.renew(b, ROCKETMQ_4, {}, NOW, None, 7)
    assert second is not first and second.route is b
    assert len(second.answers) == len(b.queues)


def _open_a(view: TableView, version: int) -> None:
    view.apply_fault("a", FaultItem("a", 0, NOW + 60_000), version)


#: Every way a replica's view changes, each opening (or ending) a's window: after it, no
#: kept answer of before may be served.
CHANGES = {
    "push": _open_a,
    "learnt from a reply": lambda v, _: v.learn_fault(FaultItem("a", 0, NOW + 60_000)),
    "own window, store away": lambda v, _: v.set_local_fault(FaultItem("a", 0, NOW + 60_000)),
    "own window dropped": lambda v, n: (_open_local(v), v.drop_local_fault("a")),
    "config": lambda v, n: v.apply_config(replace(ROCKETMQ_4, send_latency_fault_enable=False), n),
    "route": lambda v, n: v.apply_route("t", route_of([1, 3]), n),
    "snapshot": lambda v, n: v.replace(
        Snapshot(version=n, config=ROCKETMQ_4, config_version=n, routes={"t": route_of([2, 2])},
                 faults={"a": FaultItem("a", 0, NOW + 60_000)})  # fmt: skip
    ),
}


def _open_local(view: TableView) -> None:
    view.set_local_fault(FaultItem("a", 0, NOW + 60_000))
    for _ in range(8):  # a lap under the local window, kept
        service_choose(view, "t", None)


@pytest.mark.unit
@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_every_way_the_view_changes_ends_the_kept_answers(change: str) -> None:
    clock = [NOW]
    kept, full = views(ROCKETMQ_4, route_of([2, 2]), {}, clock)
    for _ in range(8):  # two laps: every start kept
        service_choose(kept, "t", None)
        selector.choose_on(full, full.routes["t"], Ask(), None, NOW)
    for v in (kept, full):
        CHANGES[change](v, 10)
    for _ in range(8):
        got = service_choose(kept, "t", None)
        route = full.routes["t"]
        want = selector.choose_on(full, route, Ask(), None, NOW)
        assert answer_of(got.choice) == answer_of(want)
        assert got.text(False) == rendered(route, want).text(False)


def counted(view: TableView, producer: str | None = "p1") -> tuple[list[int], Any]:
    """``choose_kept`` on ``view``'s topic t, with a render that counts the selects decided
    in full (a kept answer is never rendered again)."""
    full = [0]

    def render(route: Route, choice: Choice) -> tuple[Any, ...]:
        full[0] += 1
        return answer_of(choice)

    def choose(now: int = NOW, who: str | None = producer, route: Route | None = None) -> Any:
        return selector.choose_kept(view, route or view.routes["t"], who, now, render)

    return full, choose


def lapped(config: Config = ROCKETMQ_4) -> TableView:
    """A view of topic t (2 brokers x 2 queues) whose every walk start has an answer kept."""
    view = TableView(lambda: NOW)
    view.replace(Snapshot(version=1, config=config, config_version=1,
                          routes={"t": route_of([2, 2])}, faults={}))  # fmt: skip
    _, choose = counted(view)
    for _ in range(8):
        choose()
    return view


def worked_out(view: TableView) -> tuple[int, int, int]:
    """Which memo is the topic's latest, and when it was worked out (epoch, since)."""
    memo = view.memos.latest["t"]
    return id(memo), memo.epoch, memo.since


@pytest.mark.unit
def test_a_memo_answers_exactly_while_the_rule_holds() -> None:
    """The one rule (``choose_kept``): a memo answers only for the route object and config
    object it was worked out for, at its select epoch, within its window, to its producer;
    every other way it is worked out again (or a new one made) before the select."""
    view = lapped()
    memo = view.memos.latest["t"]
    before = worked_out(view)
    assert memo.until > NOW
    full, choose = counted(view)
    choose()
    choose(memo.until - 1)
    assert full[0] == 0 and worked_out(view) == before  # answered from it, both

    ways: dict[str, Any] = {
        "epoch moved": lambda v: setattr(v, "select_epoch", v.select_epoch + 1),
        "at its end": lambda v: v.memos.latest["t"].until,
        "before its start": lambda v: v.memos.latest["t"].since - 1,
        "another producer": lambda v: "p2",
        "another route object": lambda v: route_of([2, 2]),
        "another config object": lambda v: setattr(v, "config", replace(v.config)),
    }
    for why, change in ways.items():
        view = lapped()
        before = worked_out(view)
        _, choose = counted(view)
        got = change(view)
        if why in ("at its end", "before its start"):
            choose(now=got)
        elif why == "another producer":
            choose(who=got)
        elif why == "another route object":
            choose(route=got)
        else:
            choose()
        assert worked_out(view) != before, why


@pytest.mark.unit
def test_a_kept_answer_steps_the_counter_as_its_decision_did() -> None:
    """A kept answer moves the topic counter by what its decision moved it, wraps it as
    ``set_counter`` does, and makes the topic the most recently used of the counters' LRU
    (past the cap the least recently used goes, not a topic kept answers serve)."""
    view = lapped()
    full, choose = counted(view)
    state = view.selector
    state.max_topics = 3
    start = state.counter("t")
    assert view.memos.latest["t"].answers[start % 4] is not None  # kept for the start
    view.set_counter("u", 5)  # u is the most recently used
    choose()
    assert full[0] == 0
    assert state.counter("t") == start + 1  # every queue available: one step
    view.set_counter("v", 0)
    view.set_counter("w", 0)  # past the cap: u goes, not t
    assert "u" not in state.counters and state.counter("t") == start + 1

    view.set_counter("t", 0x7FFFFFFF)  # the counter wraps as set_counter's does
    choose()
    assert full[0] == 0 and state.counter("t") == 0


@pytest.mark.unit
def test_a_topics_latest_memo_follows_its_producers() -> None:
    """Two producers selecting one topic in turn on the service: each is answered from its
    own memo (none is worked out again as the topic's latest moves between them), and each
    answer is the full select's."""
    view = lapped()
    full_view = lapped()
    full, choose = counted(view)
    for _ in range(8):
        choose(who="p2")  # p2's lap: its own memo
    kept = {p: view.memos.get("t", p) for p in ("p1", "p2")}
    assert kept["p1"] is not kept["p2"] and None not in kept.values()
    full_view.set_counter("t", view.counter("t"))  # the same walk from here (starts are random)
    decided = full[0]
    for i in range(16):
        who = ("p1", "p2")[i % 2]
        got = choose(who=who)
        want = selector.choose_on(full_view, full_view.routes["t"], Ask(None, who), None, NOW)
        assert view.memos.latest["t"] is kept[who]
        assert got[0] == answer_of(want)[0]
    assert full[0] == decided  # all sixteen kept


@pytest.mark.unit
def test_another_topics_route_write_keeps_the_kept_answers() -> None:
    """A topic's answers are kept for its route object: a write of another topic's route
    keeps them (every select of every topic decided in full again after each route write
    of any topic); a write of its own route replaces them."""
    clock = [NOW]
    view = TableView(lambda: clock[0])
    view.replace(Snapshot(version=1, config=ROCKETMQ_4, config_version=1,
                          routes={"t": route_of([2, 2])}, faults={}))
    lap = [service_choose(view, "t", None) for _ in range(8)]
    kept = view.memos.latest["t"]
    full, choose = counted(view, None)

    other = wire.route({"topic": "other", "brokers": [{"brokerName": "z", "writeQueueNums": 1}]})
    view.apply_route("other", other, 2)
    assert [service_choose(view, "t", None) for _ in range(8)] == lap
    choose()
    assert full[0] == 0 and view.memos.latest["t"] is kept

    view.apply_route("t", route_of([1, 3]), 3)
    choose()
    assert full[0] == 1 and view.memos.latest["t"] is not kept
