"""When a select repeats itself: the avoidance an unkeyed select gets, and until when it holds.

``choose`` decides an unkeyed select from the route, the topic counter and the avoidance
(which brokers it avoids, and why the others are served). When no random draw and no
probe can enter the decision, the avoidance is a function of the route's fault items, this
producer's own windows and ``now``, and it changes only when ``now`` crosses one of their
window ends: ``steady`` gives it and that time. Until then, with the table unchanged in
what ``select_reads`` names, a select whose walk starts at the same queue gets the same
answer (the queue, why, the brokers passed over, the counter's step), unless it fell to
pickOneAtLeast, whose queue also depends on the counter beyond the start. Those answers
are kept (``detour.memo``) instead of deciding each select again, in the SDK and in
``POST /select`` alike (``detour.selector.choose_kept``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import NamedTuple

from detour.model import Config, FaultItem, Route
from detour.policy.avoidance import NOTHING_AVOIDED, Avoidance, avoidance, producer_windows
from detour.policy.probation import probation_on

#: ``Steady.until`` of an avoidance that no clock reading changes.
FOREVER = 1 << 62


class Steady(NamedTuple):
    """The avoidance of every unkeyed select of a route from ``now`` until ``until``."""

    #: None: a draw or a probe may decide, the selects do not repeat
    avoidance: Avoidance | None
    #: epoch ms, exclusive: the first time the clock may change ``avoidance`` (a window of
    #: the route ends, a ramp ends)
    until: int


def repeats(config: Config) -> bool:
    """Whether an unkeyed select under ``config`` can decide without a random draw: not
    with p2c (it draws its two queues), nor with an enforcementPercent strictly between 0
    and 100 (the dry run's roll). The ramp's roll is read only while a broker ramps up,
    which ``steady`` checks on the table."""
    return not config.send_latency_fault_enable or (
        config.selection != "p2c-ewma" and not 0 < config.enforcement_percent < 100
    )


def select_reads(item: FaultItem | None, config: Config) -> Hashable:
    """What of a broker's item an unkeyed select under ``config`` can read: a change of
    anything else (the latency of a healthy answer, a signal, why) leaves every select's
    answer as it was. The window end, probation, the votes behind a producer's own
    windows and, when maxAvoidedPercent ranks the avoided brokers, the latency and the
    detector's reading."""
    if item is None:
        return None
    ranked = (item.current_latency_ms, item.reachable) if config.max_avoided_percent < 100 else ()
    return (item.available_at, item.probation, item.suspects, item.slow, ranked)


def steady(
    route: Route,
    faults: Mapping[str, FaultItem],
    now_ms: int,
    config: Config,
    producer: str | None,
) -> Steady:
    """The avoidance ``choose`` gives every unkeyed select of ``route`` from ``now_ms`` until
    ``until`` whatever its draws; None instead when a draw or a probe may decide
    (``repeats`` is false, a route broker is on probation or ramping up), until it may not.

    With avoidance off every select is the plain walk (``NOTHING_AVOIDED``, forever).
    """
    if not route.queues:
        return Steady(None, now_ms)  # nothing to keep: choose raises, at once
    if not config.send_latency_fault_enable:
        return Steady(NOTHING_AVOIDED, FOREVER)
    if not repeats(config):
        return Steady(None, FOREVER)
    probation = probation_on(config)
    ramp = config.ramp_ms
    until = FOREVER
    decided = True
    for broker in route.by_broker:
        item = faults.get(broker)
        if item is None:
            continue
        end = item.available_at
        if probation and item.probation:
            decided = False  # a probe may be due, handed out once (until a report)
        elif now_ms < end:
            until = min(until, end)
        elif ramp and end and now_ms < end + ramp:
            decided = False  # ramping up: the ramp's roll decides (recovery.ramp_share)
            until = min(until, end + ramp)
    if not decided:
        return Steady(None, until)
    local = producer_windows(faults, producer, config)
    for broker in route.by_broker:
        own = local.get(broker)
        if own is not None and now_ms < own:
            until = min(until, own)
    return Steady(avoidance(route, faults, now_ms, config, 0.0, local, 0.0), until)
