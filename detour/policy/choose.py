"""One select under the whole policy: probes, keyed selects, p2c, then RocketMQ's walk."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from detour import strategy
from detour.model import Config, FaultItem, Route
from detour.policy.avoidance import Avoidance, avoidance, producer_windows, with_local
from detour.policy.keyed import ordered_pick, shard_index
from detour.policy.p2c import p2c_pick
from detour.policy.probation import probation_on


class Choice(NamedTuple):
    """One select's outcome under the whole policy."""

    selection: strategy.Selection
    avoidance: Avoidance
    #: None for an unkeyed select; "home", "wait" or "remap" for a keyed one
    ordered: str | None = None
    #: the broker this select probes (probeOnExpiry), None when it is no probe
    probe: str | None = None


@dataclass(frozen=True, slots=True)
class Draws:
    """The random values one select may use, drawn by the caller."""

    enforce: float = 0.0
    p2c_first: int = 0
    p2c_second: int = 1
    #: the staggered return's roll, uniform in [0, 1) (rampMs): 0 never skips a broker
    ramp: float = 0.0


def choose(
    route: Route,
    counter: int,
    faults: Mapping[str, FaultItem],
    now_ms: int,
    last_broker: str | None,
    config: Config,
    draws: Draws = Draws(),
    producer: str | None = None,
    sharding_key: str | None = None,
    scores: Mapping[str, float] | None = None,
    probes: Collection[str] = (),
) -> Choice:
    """One select with the whole policy; with a default config and no key or producer
    it is exactly ``strategy.select``.

    ``probes`` are the brokers on probation this select may probe (``probe_free``);
    a probe goes first: the select returns one of them (the first by name that is not
    ``last_broker``; for a keyed select only the key's own broker).

    Raises ValueError when the route has no queue.
    """
    if not config.send_latency_fault_enable:
        if sharding_key is not None:
            q, _ = ordered_pick(route, sharding_key, (), config.ordered_fallback)
            sel = strategy.Selection(q, strategy.Decision.ROUND_ROBIN, (), counter)
            return Choice(sel, Avoidance((), frozenset(), ()), "home")
        sel = strategy.select(route, counter, faults, now_ms, last_broker, False)
        return Choice(sel, Avoidance((), frozenset(), ()))
    local = producer_windows(faults, producer, config)
    av = avoidance(route, faults, now_ms, config, draws.enforce, local, draws.ramp)
    if (
        (not av.detected or (not local and not av.unenforced))
        and not probes
        and sharding_key is None
        and config.selection != "p2c-ewma"
        and not probation_on(config)
        and not config.ramp_ms
    ):
        # The common case, checked first because it runs on almost every select: nothing
        # is avoided, or the table's windows alone decide; exactly RocketMQ's walk.
        return Choice(strategy.select(route, counter, faults, now_ms, last_broker, True), av)
    # the avoided brokers in route order, for the answers built here (not the walk's)
    order = [b for b in av.detected if b in av.enforced]
    if probes:
        probe = _probe(route, counter, av, probes, last_broker, sharding_key, order)
        if probe is not None:
            return probe
    if sharding_key is not None:
        q, how = ordered_pick(route, sharding_key, av.enforced, config.ordered_fallback)
        decision = (
            strategy.Decision.PICK_ONE_AT_LEAST
            if q.broker_name in av.enforced
            else strategy.Decision.AVAILABLE
        )
        avoided = tuple(b for b in order if b != q.broker_name) if how != "home" else ()
        return Choice(strategy.Selection(q, decision, avoided, counter), av, how)
    if config.selection == "p2c-ewma":
        q2 = p2c_pick(
            route, av.enforced, last_broker, scores or {}, draws.p2c_first, draws.p2c_second
        )
        if q2 is not None:
            avoided = tuple(b for b in order if b != q2.broker_name)
            sel = strategy.Selection(q2, strategy.Decision.AVAILABLE, avoided, counter + 1)
            return Choice(sel, av)
    if not local and not av.unenforced and not probation_on(config) and not config.ramp_ms:
        return Choice(strategy.select(route, counter, faults, now_ms, last_broker, True), av)
    sel = strategy.select(
        route, counter, with_local(faults, local), now_ms, last_broker, True, av.enforced
    )
    return Choice(sel, av)


def _probe(
    route: Route,
    counter: int,
    av: Avoidance,
    probes: Collection[str],
    last_broker: str | None,
    sharding_key: str | None,
    order: list[str],
) -> Choice | None:
    if sharding_key is not None:
        home = route.queues[shard_index(sharding_key, len(route.queues))]
        if home.broker_name not in probes or home.broker_name not in av.enforced:
            return None
        avoided = tuple(b for b in order if b != home.broker_name)
        sel = strategy.Selection(home, strategy.Decision.AVAILABLE, avoided, counter)
        return Choice(sel, av, "home", home.broker_name)
    for broker in sorted(b for b in route.by_broker if b in probes and b in av.enforced):
        if broker == last_broker:
            continue
        queues = route.by_broker[broker]
        q = queues[counter % len(queues)]
        avoided = tuple(b for b in order if b != broker)
        sel = strategy.Selection(q, strategy.Decision.AVAILABLE, avoided, counter + 1)
        return Choice(sel, av, None, broker)
    return None
