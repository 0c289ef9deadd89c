"""Unit and property tests for the pure avoidance policy (detour.policy).

Every knob at its default must leave RocketMQ's strategy unchanged
(``test_default_config_is_the_strategy``); each knob then has properties of its own.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detour import policy, strategy
from detour.model import Config, FaultItem, Route
from tests.budget import examples
from tests.rule import applied
from tests.test_strategy import NOW, Scenario, brokers_of, make_route, scenarios

pytestmark = pytest.mark.unit

HYP = settings(max_examples=examples(), deadline=None)
rolls = st.floats(0, 1, exclude_max=True)
percents = st.integers(0, 100)


def choose(sc: Scenario, config: Config, **kw: object) -> policy.Choice:
    return policy.choose(
        sc.route,
        sc.counter,
        sc.faults,
        sc.now,
        sc.last_broker,
        config,
        **kw,  # type: ignore[arg-type]
    )


def open_brokers(sc: Scenario) -> set[str]:
    return {
        b for b in brokers_of(sc.route) if b in sc.faults and sc.now < sc.faults[b].available_at
    }


# ---------------------------------------------------------------- defaults


@HYP
@given(scenarios(), rolls, st.booleans())
def test_default_config_is_the_strategy(sc: Scenario, roll: float, enabled: bool) -> None:
    config = Config(send_latency_fault_enable=enabled)
    got = choose(sc, config, draws=policy.Draws(enforce=roll), producer="p1")
    assert got.selection == strategy.select(
        sc.route, sc.counter, sc.faults, sc.now, sc.last_broker, enabled
    )
    assert got.ordered is None


# ---------------------------------------------------------------- ordered selects


@HYP
@given(scenarios(), st.text(max_size=40), st.sampled_from(["wait", "remap"]))
def test_keyed_select_is_stable_and_uses_the_home_queue_when_available(
    sc: Scenario, key: str, fallback: str
) -> None:
    config = Config(ordered_fallback=fallback)
    a = choose(sc, config, sharding_key=key)
    b = choose(dataclasses.replace(sc, counter=sc.counter + 17), config, sharding_key=key)
    assert a.selection.queue == b.selection.queue  # the counter plays no part
    assert a.selection.next_counter == sc.counter
    home = sc.route.queues[policy.shard_index(key, len(sc.route.queues))]
    avoided = open_brokers(sc)
    if home.broker_name not in avoided:
        assert (a.selection.queue, a.ordered) == (home, "home")
    elif fallback == "wait" or avoided >= set(brokers_of(sc.route)):
        assert (a.selection.queue, a.ordered) == (home, "wait")
        assert a.selection.decision is strategy.Decision.PICK_ONE_AT_LEAST
    else:
        assert a.ordered == "remap"
        assert a.selection.queue.broker_name not in avoided
        # The next available queue after home, cyclically.
        n = len(sc.route.queues)
        i = sc.route.queues.index(home)
        nxt = next(
            sc.route.queues[(i + k) % n]
            for k in range(1, n)
            if sc.route.queues[(i + k) % n].broker_name not in avoided
        )
        assert a.selection.queue == nxt


@given(st.lists(st.text(min_size=1, max_size=12), min_size=200, max_size=200, unique=True))
@settings(max_examples=examples(20), deadline=None)
def test_shard_index_spreads_keys(keys: list[str]) -> None:
    counts = Counter(policy.shard_index(k, 4) for k in keys)
    assert len(counts) == 4 and min(counts.values()) >= 20


def test_shard_index_is_crc32() -> None:
    # Java: CRC32 c = new CRC32(); c.update("order-42".getBytes(UTF_8)); c.getValue() % 7
    assert policy.shard_index("order-42", 7) == zlib.crc32(b"order-42") % 7
    assert policy.shard_index("123456789", 1 << 32) == 0xCBF43926  # CRC-32's check value


def test_keyed_select_with_avoidance_off_is_the_home_queue() -> None:
    route = make_route({"a": 2, "b": 2})
    faults = {"a": FaultItem("a", 0, NOW + 1000), "b": FaultItem("b", 0, NOW + 1000)}
    got = policy.choose(
        route, 0, faults, NOW, None, Config(send_latency_fault_enable=False), sharding_key="k"
    )
    assert got.selection.queue == route.queues[policy.shard_index("k", 4)]
    assert got.selection.decision is strategy.Decision.ROUND_ROBIN


# ---------------------------------------------------------------- limits and panic


@HYP
@given(scenarios(), percents, percents)
def test_max_avoided_percent_caps_the_enforced_set(sc: Scenario, cap: int, panic: int) -> None:
    config = Config(max_avoided_percent=cap, panic_threshold_percent=panic)
    av = policy.avoidance(sc.route, sc.faults, sc.now, config, 0.0)
    n = len(sc.route.by_broker)
    assert set(av.detected) == open_brokers(sc)
    assert len(av.enforced) <= n * cap // 100
    assert av.enforced <= set(av.detected)
    assert set(av.unenforced) | av.enforced == set(av.detected)
    if av.panic:
        assert not av.enforced
    elif av.unenforced:
        # The released ones rank better than every one still avoided.
        ranked = strategy.rank_brokers(list(av.detected), sc.faults, sc.now)
        assert set(ranked[: len(av.unenforced)]) == set(av.unenforced)
    if not av.panic and panic:
        assert (n - len(av.enforced)) * 100 >= panic * n


@HYP
@given(scenarios(), st.integers(1, 100))
def test_panic_spreads_over_every_broker(sc: Scenario, threshold: int) -> None:
    config = Config(panic_threshold_percent=threshold)
    got = choose(sc, config)
    n = len(sc.route.by_broker)
    available = n - len(open_brokers(sc))
    assert got.avoidance.panic == (bool(open_brokers(sc)) and available * 100 < threshold * n)
    if got.avoidance.panic:
        assert got.selection == strategy.select(
            sc.route, sc.counter, sc.faults, sc.now, sc.last_broker, True, frozenset()
        )
        assert got.selection.decision is strategy.Decision.AVAILABLE


def test_max_avoided_serves_the_least_bad() -> None:
    route = make_route({"a": 1, "b": 1, "c": 1, "d": 1})
    faults = {b: FaultItem(b, lat, NOW + 10_000) for b, lat in (("a", 5), ("b", 1), ("c", 9))}
    got = policy.choose(route, 0, faults, NOW, None, Config(max_avoided_percent=50))
    assert got.avoidance.enforced == {"a", "c"}
    assert got.avoidance.unenforced == ("b",)
    picks = {
        policy.choose(route, c, faults, NOW, None, Config(max_avoided_percent=50)).selection.queue
        for c in range(8)
    }
    assert {q.broker_name for q in picks} == {"b", "d"}


# ---------------------------------------------------------------- dry run


@HYP
@given(scenarios(), percents, rolls)
def test_enforcement_share(sc: Scenario, pct: int, roll: float) -> None:
    config = Config(enforcement_percent=pct)
    got = choose(sc, config, draws=policy.Draws(enforce=roll))
    enforced = roll * 100 < pct
    if not open_brokers(sc):
        assert not got.avoidance.dry_run
    elif enforced:
        assert not got.avoidance.dry_run
        assert got.selection == strategy.select(
            sc.route, sc.counter, sc.faults, sc.now, sc.last_broker, True
        )
    else:
        assert got.avoidance.dry_run and not got.avoidance.enforced
        assert set(got.avoidance.unenforced) == open_brokers(sc)
        assert got.selection.avoided_brokers == ()


def test_enforcement_share_over_many_rolls() -> None:
    route = make_route({"a": 1, "b": 1})
    faults = {"a": FaultItem("a", 0, NOW + 10_000)}
    config = Config(enforcement_percent=30)
    enforced = sum(
        not policy.choose(
            route, i, faults, NOW, None, config, policy.Draws(i / 1000)
        ).avoidance.dry_run
        for i in range(1000)
    )
    assert enforced == 300


# ---------------------------------------------------------------- p2c-ewma


@HYP
@given(scenarios(), st.integers(0, 2**32), st.integers(0, 2**32), st.data())
def test_p2c_picks_an_available_queue_and_the_lower_score(
    sc: Scenario, r1: int, r2: int, data: st.DataObject
) -> None:
    brokers = brokers_of(sc.route)
    scores = {b: data.draw(st.floats(0, 1e4)) for b in brokers}
    got = choose(sc, Config(selection="p2c-ewma"), draws=policy.Draws(0.0, r1, r2), scores=scores)
    avoided = open_brokers(sc)
    usable = [q for q in sc.route.queues if q.broker_name not in avoided]
    if not usable:
        assert got.selection.decision is strategy.Decision.PICK_ONE_AT_LEAST
        return
    q = got.selection.queue
    assert q.broker_name not in avoided
    others = [x for x in usable if x.broker_name != sc.last_broker]
    if others:
        assert q.broker_name != sc.last_broker
        cands = others
    else:
        cands = usable
    i = r1 % len(cands)
    if len(cands) > 1:
        j = r2 % (len(cands) - 1)
        pair = {cands[i], cands[j + 1 if j >= i else j]}
        assert q in pair
        assert scores[q.broker_name] == min(scores[x.broker_name] for x in pair)


def test_p2c_prefers_the_faster_broker() -> None:
    route = make_route({"fast": 4, "slow": 4})
    scores = {"fast": 5.0, "slow": 500.0}
    picks = Counter(
        policy.choose(
            route,
            0,
            {},
            NOW,
            None,
            Config(selection="p2c-ewma"),
            policy.Draws(0.0, r1, r2),
            scores=scores,
        ).selection.queue.broker_name
        for r1 in range(8)
        for r2 in range(7)
    )
    # Only a pair of two slow queues yields slow: 4*3 of 8*7 ordered pairs.
    assert picks == {"fast": 44, "slow": 12}


@given(st.floats(0, 1e5), st.floats(0, 1e5), st.integers(0, 10**6))
@HYP
def test_peak_ewma(old: float, sample: float, dt: int) -> None:
    new = policy.peak_ewma(old, NOW, sample, NOW + dt)
    if sample >= old:
        assert new == sample
    else:
        assert sample <= new <= old
    assert policy.peak_ewma(None, 0, sample, NOW) == sample


# ---------------------------------------------------------------- quorum and origin


QUORUM = Config(isolation_quorum=3, quorum_window_ms=60_000)


def test_quorum_needs_distinct_producers_within_the_window() -> None:
    item = None
    for i, who in enumerate(["p1", "p1", "p2"]):
        out = applied(item, "a", 0, True, "local", who, NOW + i, NOW + i, QUORUM)
        assert out.suspected and not out.quorum_reached
        assert out.item.available_at <= NOW + i  # nobody but the reporters avoids it
        item = out.item
    assert item is not None and {p for p, _ in item.suspects} == {"p1", "p2"}
    out = applied(item, "a", 0, True, None, "p3", NOW + 5, NOW + 5, QUORUM)
    assert out.quorum_reached and out.item.suspects == ()
    assert out.item.available_at == NOW + 5 + 600_000


def test_quorum_forgets_old_failures() -> None:
    out = applied(None, "a", 0, True, "local", "p1", NOW, NOW, QUORUM)
    out = applied(out.item, "a", 0, True, "local", "p2", NOW, NOW, QUORUM)
    late = NOW + 60_001
    out = applied(out.item, "a", 0, True, "local", "p3", late, late, QUORUM)
    assert out.suspected


def test_broker_origin_isolates_at_once() -> None:
    out = applied(None, "a", 0, True, "broker", "p1", NOW, NOW, QUORUM)
    assert not out.suspected and out.item.available_at == NOW + 600_000


def test_a_lone_reporter_avoids_the_broker_itself() -> None:
    route = make_route({"a": 2, "b": 2})
    out = applied(None, "a", 0, True, "local", "p1", NOW, NOW, QUORUM)
    faults = {"a": out.item}
    for c in range(8):
        mine = policy.choose(route, c, faults, NOW + 1, None, QUORUM, producer="p1")
        assert mine.selection.queue.broker_name == "b"
        assert mine.selection.avoided_brokers in ((), ("a",))
    others = {
        policy.choose(route, c, faults, NOW + 1, None, QUORUM, producer="p2").selection.queue
        for c in range(4)
    }
    assert {q.broker_name for q in others} == {"a", "b"}
    # Until its own window would have ended.
    later = policy.choose(route, 0, faults, NOW + 600_000, None, QUORUM, producer="p1")
    assert later.avoidance.detected == ()


@HYP
@given(
    st.lists(
        st.tuples(st.sampled_from(["p1", "p2", "p3", "p4", "p5"]), st.integers(0, 200_000)),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 6),
    st.integers(1, 100_000),
)
def test_quorum_reached_iff_enough_recent_voters(
    events: list[tuple[str, int]], quorum: int, window: int
) -> None:
    config = Config(isolation_quorum=quorum, quorum_window_ms=window)
    suspects: tuple[tuple[str, int], ...] = ()
    history: list[tuple[str, int]] = []
    now = NOW
    for who, dt in events:
        now += dt
        suspects, reached = policy.quorum_step(suspects, who, now, now, config)
        history.append((who, now))
        voters = {p for p, a in history if a > now - window}
        assert reached == (len(voters) >= quorum)
        if reached:
            history = []
            assert suspects == ()
        assert len(suspects) <= policy.MAX_SUSPECTS


@HYP
@given(scenarios(), st.booleans(), st.sampled_from([None, "broker", "local"]))
def test_default_config_report_is_the_strategy(
    sc: Scenario, isolation: bool, origin: str | None
) -> None:
    config = Config()
    for broker in brokers_of(sc.route):
        old = sc.faults.get(broker)
        out = applied(old, broker, 700, isolation, origin, "p", sc.now, sc.now, config)
        duration = strategy.report_duration(config, 700, isolation)
        expected = strategy.apply_report(old, broker, 700, duration, sc.now, False)
        assert (out.item.current_latency_ms, out.item.available_at) == (
            expected.current_latency_ms,
            expected.available_at,
        )
        assert out.duration_ms == duration and not out.suspected


# ---------------------------------------------------------------- backoff and jitter


BACKOFF = Config(repeat_multiplier=True, max_isolation_ms=2_000_000, repeat_decay_ms=100_000)


def test_backoff_multiplies_caps_and_decays() -> None:
    item = None
    now = NOW
    lengths = []
    for _ in range(5):
        out = applied(item, "a", 0, True, None, "", now, now, BACKOFF)
        lengths.append(out.duration_ms)
        item = out.item
        now = item.available_at  # fails again right as the window ends
    assert lengths == [600_000, 1_200_000, 1_800_000, 2_000_000, 2_000_000]
    assert item is not None and item.isolations == 5
    # 250 s healthy after its window: two decay steps, then this failure adds one.
    later = item.available_at + 250_000
    out = applied(item, "a", 0, True, None, "", later, later, BACKOFF)
    assert out.item.isolations == 4 and out.duration_ms == 2_000_000


def test_failure_inside_an_open_window_keeps_the_count() -> None:
    out = applied(None, "a", 0, True, None, "", NOW, NOW, BACKOFF)
    again = applied(out.item, "a", 0, True, None, "", NOW + 10, NOW + 10, BACKOFF)
    assert again.item.isolations == 1 and again.duration_ms == 600_000


@HYP
@given(
    st.integers(0, 10),
    st.integers(0, 10**7),
    st.integers(0, 10**6),
    st.integers(1, 10**6),
    st.integers(0, 100),
    st.integers(0, policy.JITTER_SCALE - 1),
)
def test_backoff_bounds(count: int, idle: int, base: int, cap: int, jitter: int, roll: int) -> None:
    config = Config(repeat_multiplier=True, max_isolation_ms=cap, jitter_percent=jitter)
    old = FaultItem("a", 0, NOW, isolations=count)
    length, n = policy.backoff(config, base, old, NOW + idle, roll)
    plain = max(base, min(base * n, cap)) if base else 0
    assert plain <= length <= plain + plain * jitter // 100
    assert base == 0 or 1 <= n <= count + 1


def test_jitter_off_means_no_jitter_and_default_no_backoff() -> None:
    out = applied(None, "a", 0, True, None, "", NOW, NOW, Config(), jitter_roll=9_999)
    assert out.duration_ms == 600_000 and out.item.isolations == 0
    cfg = Config(jitter_percent=10)
    out = applied(None, "a", 0, True, None, "", NOW, NOW, cfg, jitter_roll=5_000)
    assert out.duration_ms == 630_000


def test_route_without_queues_is_refused() -> None:
    with pytest.raises(ValueError):
        policy.choose(Route.from_queues("t", []), 0, {}, NOW, None, Config(), sharding_key="k")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"selection": "random"},
        {"ordered_fallback": "drop"},
        {"max_avoided_percent": 101},
        {"panic_threshold_percent": -1},
        {"enforcement_percent": 101},
        {"isolation_quorum": 0},
        {"isolation_quorum": 65},
        {"quorum_window_ms": 0},
        {"jitter_percent": 101},
        {"repeat_decay_ms": 0},
        {"max_isolation_ms": 0},
    ],
)
def test_config_rejects_bad_policy(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Config(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "isolation", "quorum", "expected"),
    [
        (strategy.WindowChange.NONE, True, True, None),
        (strategy.WindowChange.OPENED, True, False, ("opened", "isolation")),
        (strategy.WindowChange.OPENED, False, False, ("opened", "latency")),
        (strategy.WindowChange.OPENED, True, True, ("quorum", "quorum")),
        (strategy.WindowChange.MOVED, True, False, ("extended", "isolation")),
        (strategy.WindowChange.MOVED, False, False, ("extended", "latency")),
        (strategy.WindowChange.CLEARED, False, False, ("ended", "success")),
    ],
)
def test_window_event(
    change: strategy.WindowChange, isolation: bool, quorum: bool, expected: object
) -> None:
    assert policy.window_event(change, isolation, quorum) == expected


@HYP
@given(st.integers(0, 3), st.booleans(), st.booleans())
def test_every_visible_change_is_one_event(change: int, isolation: bool, quorum: bool) -> None:
    kind = strategy.WindowChange(change)
    event = policy.window_event(kind, isolation, quorum)
    assert (event is None) == (kind is strategy.WindowChange.NONE)


# ---------------------------------------------------------------- probation probe

PROBE = Config(probe_on_expiry=True, probe_timeout_ms=5_000)


def test_probe_lifecycle_in_reports() -> None:
    opened = applied(None, "a", 0, True, None, "", NOW, NOW, PROBE)
    assert opened.item.probation and opened.probe is None
    end = opened.item.available_at
    # A success inside the window changes nothing about the probation.
    early = applied(opened.item, "a", 5, False, None, "", end - 1, end - 1, PROBE)
    assert early.item.probation and early.probe is None
    # After the window: a success re-opens the broker to all.
    passed = applied(opened.item, "a", 5, False, None, "", end, end, PROBE)
    assert not passed.item.probation and passed.probe == "passed"
    assert policy.window_event(strategy.WindowChange.NONE, False, False, "passed") == (
        "ended", "probe")
    # A failure re-isolates (with backoff when on) and stays on probation.
    cfg = dataclasses.replace(PROBE, repeat_multiplier=True)
    first = applied(None, "a", 0, True, None, "", NOW, NOW, cfg)
    failed = applied(first.item, "a", 0, True, None, "", first.item.available_at,
                          first.item.available_at, cfg)
    assert failed.probe == "failed" and failed.item.probation
    assert failed.duration_ms == 1_200_000 and failed.item.isolations == 2
    # With the probe off nothing is on probation.
    assert not applied(None, "a", 0, True, None, "", NOW, NOW, Config()).item.probation


def test_probe_goes_to_one_select() -> None:
    route = make_route({"a": 2, "b": 2})
    item = FaultItem("a", 0, NOW, probation=True)  # window ended just now
    faults = {"a": item}
    assert policy.on_probation(item, NOW, PROBE)
    assert not policy.on_probation(item, NOW - 1, PROBE)
    got = policy.choose(route, 3, faults, NOW, None, PROBE, probes={"a"})
    assert got.probe == "a" and got.selection.queue.broker_name == "a"
    # Without a free probe the broker stays avoided.
    for c in range(6):
        other = policy.choose(route, c, faults, NOW, None, PROBE)
        assert other.selection.queue.broker_name == "b" and other.probe is None
        assert other.avoidance.detected == ("a",)
    # The retry of a failed probe does not go back to it.
    retry = policy.choose(route, 0, faults, NOW, "a", PROBE, probes={"a"})
    assert retry.probe is None and retry.selection.queue.broker_name == "b"


def test_probe_free_one_per_window_and_after_timeout() -> None:
    item = FaultItem("a", 0, NOW, probation=True)
    assert policy.probe_free(item, NOW, PROBE, None)
    assert not policy.probe_free(item, NOW + 4_999, PROBE, (NOW, NOW))
    assert policy.probe_free(item, NOW + 5_000, PROBE, (NOW, NOW))
    assert policy.probe_free(item, NOW, PROBE, (NOW - 10, NOW))  # an earlier window's probe
    assert not policy.probe_free(item, NOW, Config(), None)


@HYP
@given(scenarios(), st.data())
def test_probation_brokers_get_only_probes(sc: Scenario, data: st.DataObject) -> None:
    brokers = brokers_of(sc.route)
    on = set(data.draw(st.lists(st.sampled_from(brokers), unique=True)))
    faults = dict(sc.faults)
    for b in on:
        end = faults[b].available_at if b in faults else sc.now
        faults[b] = FaultItem(b, 0, min(end, sc.now), probation=True)
    probes = set(data.draw(st.lists(st.sampled_from(brokers), unique=True))) & on
    got = policy.choose(sc.route, sc.counter, faults, sc.now, sc.last_broker, PROBE,
                        probes=probes)
    b = got.selection.queue.broker_name
    if got.probe is not None:
        assert got.probe == b and b in probes and b != sc.last_broker
    elif b in on:
        # Only when nothing else was available (pickOneAtLeast) or the retry rule left it.
        assert got.selection.decision is strategy.Decision.PICK_ONE_AT_LEAST


# ---------------------------------------------------------------- active detector


@HYP
@given(scenarios(), st.data())
def test_ranking_prefers_reachable_brokers(sc: Scenario, data: st.DataObject) -> None:
    faults = {
        b: dataclasses.replace(i, reachable=data.draw(st.sampled_from([None, True, False])))
        for b, i in sc.faults.items()
    }
    brokers = brokers_of(sc.route)
    ranked = strategy.rank_brokers(brokers, faults, sc.now)
    def avail(b: str) -> bool:
        return b not in faults or faults[b].is_available(sc.now)
    def down(b: str) -> bool:
        return b in faults and faults[b].reachable is False
    keys = [(not avail(b), down(b)) for b in ranked]
    assert keys == sorted(keys)
    # Without readings, the order is RocketMQ's.
    plain = {b: dataclasses.replace(i, reachable=None) for b, i in faults.items()}
    assert strategy.rank_brokers(brokers, plain, sc.now) == strategy.rank_brokers(
        brokers, sc.faults, sc.now)


def test_pick_one_at_least_takes_the_reachable_broker() -> None:
    route = make_route({"a": 1, "b": 1})
    faults = {"a": FaultItem("a", 900, NOW + 10_000, reachable=True),
              "b": FaultItem("b", 5, NOW + 10_000, reachable=False)}
    got = policy.choose(route, 0, faults, NOW, None, Config())
    assert (got.selection.queue.broker_name, got.selection.decision) == (
        "a", strategy.Decision.PICK_ONE_AT_LEAST)


def test_detector_targets_and_addresses() -> None:
    from detour.model import BrokerRoute
    from service import detector

    route = Route.from_brokers("t", [BrokerRoute("a", 1, "10.0.0.5:10911"),
                                     BrokerRoute("b", 1, None), BrokerRoute("c", 1, "[::1]:9"),
                                     BrokerRoute("d", 1, "h:1")])
    faults = {"a": FaultItem("a", 0, NOW + 1), "b": FaultItem("b", 0, NOW + 1),
              "c": FaultItem("c", 0, NOW, probation=True), "d": FaultItem("d", 0, NOW)}
    assert detector.targets({"t": route}, faults, NOW, Config()) == {"a": "10.0.0.5:10911"}
    assert detector.targets({"t": route}, faults, NOW, PROBE) == {
        "a": "10.0.0.5:10911", "c": "[::1]:9"}
    assert detector.split_address("[::1]:9") == ("::1", 9)
    assert detector.split_address("broker.example:10911") == ("broker.example", 10911)


@given(st.floats(0, 1e5), st.integers(0, 10**7))
@HYP
def test_idle_score_fades(value: float, idle: int) -> None:
    got = policy.idle_score(value, NOW, NOW + idle)
    assert 0 <= got <= value
    assert policy.idle_score(value, NOW, NOW) == value
