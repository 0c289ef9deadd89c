"""Which open windows one select obeys: the producer's own windows, the dry run, the
avoidance cap (maxAvoidedPercent) and the panic threshold."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from detour import strategy
from detour.model import Config, FaultItem, Route
from detour.policy.probation import probation_on
from detour.policy.recovery import ramp_skips


class Avoidance(NamedTuple):
    """Which of a route's brokers one select avoids, and why the others are not.

    A NamedTuple, as ``Choice`` and ``strategy.Selection``: immutable and cheap to build
    on every select (docs/BENCHMARKS.md, "One select everywhere").
    """

    #: brokers with an open window, for everyone or for this producer, in route order
    detected: tuple[str, ...]
    #: the brokers this select avoids
    enforced: frozenset[str]
    #: detected but served: panic, a dry run, or past maxAvoidedPercent (best first)
    unenforced: tuple[str, ...]
    panic: bool = False
    dry_run: bool = False


NOTHING_AVOIDED = Avoidance((), frozenset(), ())


def producer_windows(
    faults: Mapping[str, FaultItem], producer: str | None, config: Config
) -> dict[str, int]:
    """Window ends (ms) that apply to ``producer`` alone: its failures short of the
    isolation quorum and its slow answers short of the latency quorum.

    A lone reporter may have a broken link, a cold connection or a GC pause of its own;
    it keeps away from the broker as RocketMQ's per-producer table would, without
    deciding for every producer.
    """
    if producer is None or (config.isolation_quorum <= 1 and config.latency_quorum <= 1):
        return {}
    duration = strategy.report_duration(config, 0, True)
    out: dict[str, int] = {}
    for broker, item in faults.items():
        for who, at in item.suspects:
            if who == producer:
                out[broker] = max(out.get(broker, 0), at + duration)
        for who, _, end in item.slow:
            if who == producer:
                out[broker] = max(out.get(broker, 0), end)
    return out


def avoidance(
    route: Route,
    faults: Mapping[str, FaultItem],
    now_ms: int,
    config: Config,
    enforce_roll: float,
    local: Mapping[str, int] | None = None,
    ramp_roll: float = 0.0,
) -> Avoidance:
    """Decide which open windows this select obeys.

    ``enforce_roll`` is a uniform draw in [0, 1): the select enforces windows when
    ``roll * 100 < enforcementPercent``. ``local`` holds windows of this producer
    alone (``producer_windows``). ``ramp_roll``, a uniform draw in [0, 1), decides which
    brokers still ramping up after their window this select skips (``ramp_skips``; they
    count as detected, like an open window). Order: the dry run first (an unenforced
    select obeys nothing), then maxAvoidedPercent (the worst brokers stay avoided, the
    least bad by pickOneAtLeast's ranking are served), then the panic threshold on
    what remains available.
    """
    brokers = route.by_broker
    # A plain loop with on_probation inlined: this runs on every select. Detected: an
    # open window, one that has ended on a broker still on probation, or this
    # producer's own window.
    probation = probation_on(config)
    ramp = config.ramp_ms
    found: list[str] = []
    for b in brokers:
        item = faults.get(b)
        if (
            item is not None
            and (
                now_ms < item.available_at
                or (probation and item.probation)
                or (ramp and ramp_skips(item, now_ms, config, ramp_roll))
            )
        ) or (local and now_ms < local.get(b, 0)):
            found.append(b)
    if not found:
        return NOTHING_AVOIDED
    detected = tuple(found)
    local = local or {}
    if enforce_roll * 100 >= config.enforcement_percent:
        return Avoidance(detected, frozenset(), detected, dry_run=True)
    enforced = list(detected)
    released: list[str] = []
    cap = len(brokers) * config.max_avoided_percent // 100
    if len(enforced) > cap:
        ranked = strategy.rank_brokers(enforced, with_local(faults, local), now_ms)
        released = ranked[: len(enforced) - cap]
        enforced = ranked[len(enforced) - cap :]
    available = len(brokers) - len(enforced)
    if config.panic_threshold_percent and available * 100 < (
        config.panic_threshold_percent * len(brokers)
    ):
        return Avoidance(detected, frozenset(), detected, panic=True)
    return Avoidance(detected, frozenset(enforced), tuple(released))


def with_local(faults: Mapping[str, FaultItem], local: Mapping[str, int]) -> dict[str, FaultItem]:
    """The table as this producer sees it: its own windows count as open ones."""
    if not local:
        return dict(faults)
    out = dict(faults)
    for broker, end in local.items():
        item = out.get(broker)
        if item is None:
            out[broker] = FaultItem(broker, 0, end)
        elif end > item.available_at:
            out[broker] = FaultItem(broker, item.current_latency_ms, end)
    return out
