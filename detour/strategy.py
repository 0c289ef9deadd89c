"""The fault strategy, pure: RocketMQ's MQFaultStrategy with Detour's fixes, no I/O, no clock.

Every function takes ``now`` (epoch ms) so the service, the stores, the SDK
and the tests share one implementation and tests never sleep.

Differences from RocketMQ 4.x, all deliberate (see docs/semantics.md):

* the round-robin counter advances once per *probed* queue, so when a broker
  is avoided its share spreads evenly instead of landing on the queue after it;
* the retry rule is what RocketMQ meant: prefer an available queue that is
  not on ``last_broker``, then any available one, then pickOneAtLeast;
* a report extends a window (``max``) unless ``last_report_wins`` (4.x rule);
* pickOneAtLeast sorts with one ``now``, ties broken by broker name, and
  spreads over the better half's queues with the topic counter.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from enum import IntEnum, StrEnum
from typing import NamedTuple

from detour.model import Config, FaultItem, Queue, Route


class Decision(StrEnum):
    AVAILABLE = "available"
    PICK_ONE_AT_LEAST = "pick_one_at_least"
    ROUND_ROBIN = "round_robin"


class Selection(NamedTuple):
    """A queue chosen, and why (a NamedTuple: built on every select, cheaply)."""

    queue: Queue
    decision: Decision
    #: brokers passed over because their window is open, in the order met;
    #: never contains the returned broker.
    avoided_brokers: tuple[str, ...]
    #: the topic counter to use for the next select.
    next_counter: int


def tier(config: Config, latency_ms: int, isolation: bool = False) -> int | None:
    """Index of the latency tier a report falls in (top-down scan), None below every tier.

    A failure counts as ``isolation_latency_ms``.
    """
    latency = config.isolation_latency_ms if isolation else latency_ms
    tiers = config.latency_max
    for i in range(len(tiers) - 1, -1, -1):
        if latency >= tiers[i]:
            return i
    return None


def not_available_duration(config: Config, latency_ms: int) -> int:
    """Window length in ms for a latency: scan tiers from the top, first ``latency >= max`` wins."""
    i = tier(config, latency_ms)
    return 0 if i is None else config.not_available_duration[i]


def report_duration(config: Config, latency_ms: int, isolation: bool) -> int:
    """Window length in ms a report opens; a failure counts as ``isolation_latency_ms``."""
    i = tier(config, latency_ms, isolation)
    return 0 if i is None else config.not_available_duration[i]


def updated_available_at(
    old_available_at: int | None, now_ms: int, duration_ms: int, last_report_wins: bool
) -> int:
    """The window end after a report: overwrite (4.x) or only ever extend (5.1.4+, default)."""
    candidate = now_ms + duration_ms
    if last_report_wins or old_available_at is None:
        return candidate
    return max(old_available_at, candidate)


def apply_report(
    old: FaultItem | None,
    broker_name: str,
    latency_ms: int,
    duration_ms: int,
    now_ms: int,
    last_report_wins: bool,
) -> FaultItem:
    """The fault item after one report (LatencyFaultToleranceImpl.updateFaultItem)."""
    end = updated_available_at(
        None if old is None else old.available_at, now_ms, duration_ms, last_report_wins
    )
    return FaultItem(broker_name, latency_ms, end)


class WindowChange(IntEnum):
    """What a report did to what selects see (the codes report.lua returns)."""

    NONE = 0
    OPENED = 1
    MOVED = 2
    CLEARED = 3


def window_change(old_available_at: int | None, new_available_at: int, now_ms: int) -> WindowChange:
    """Whether a report opened, moved or cleared a window, or changed nothing visible.

    Most reports change nothing (a fast broker stays available), and only
    changes are pushed to other replicas.
    """
    was_open = old_available_at is not None and old_available_at > now_ms
    is_open = new_available_at > now_ms
    if is_open and not was_open:
        return WindowChange.OPENED
    if is_open and new_available_at != old_available_at:
        return WindowChange.MOVED
    if was_open and not is_open:
        return WindowChange.CLEARED
    return WindowChange.NONE


def _is_avoided(faults: Mapping[str, FaultItem], broker: str, now_ms: int) -> bool:
    item = faults.get(broker)
    return item is not None and now_ms < item.available_at


def select(
    route: Route,
    counter: int,
    faults: Mapping[str, FaultItem],
    now_ms: int,
    last_broker: str | None,
    enabled: bool,
    avoid: Collection[str] | None = None,
) -> Selection:
    """Choose a queue of ``route`` (MQFaultStrategy.selectOneMessageQueue).

    The walk starts at ``counter % len(queues)`` and each probed queue advances
    the counter by one. A broker's queues are contiguous, so a skipped broker is
    jumped over in one step with the same counter arithmetic as probing each.
    ``avoid``, when given, is the set of brokers to avoid instead of those whose
    window is open in ``faults`` (the policy's panic, dry-run and limit rules
    decide it; ``faults`` still ranks brokers for pickOneAtLeast).

    Raises ValueError when the route has no queue.
    """
    queues = route.queues
    n = len(queues)
    if n == 0:
        raise ValueError("route has no queues")
    start = counter % n

    if not enabled:
        # TopicPublishInfo.selectOneMessageQueue(lastBrokerName).
        steps, pos = 0, start
        while steps < n:
            q = queues[pos]
            if q.broker_name != last_broker:
                return Selection(q, Decision.ROUND_ROBIN, (), counter + steps + 1)
            jump = min(route.run_end[pos] - pos, n - steps)
            steps += jump
            pos = (pos + jump) % n
        return Selection(queues[start], Decision.ROUND_ROBIN, (), counter + 1)

    avoided: list[str] = []
    fallback: int | None = None  # steps to the first available queue on last_broker
    steps, pos = 0, start
    while steps < n:
        q = queues[pos]
        broker = q.broker_name
        if broker in avoid if avoid is not None else _is_avoided(faults, broker, now_ms):
            if broker not in avoided:
                avoided.append(broker)
        elif broker != last_broker:
            return Selection(q, Decision.AVAILABLE, tuple(avoided), counter + steps + 1)
        elif fallback is None:
            fallback = steps
        jump = min(route.run_end[pos] - pos, n - steps)
        steps += jump
        pos = (pos + jump) % n

    if fallback is not None:
        q = queues[(start + fallback) % n]
        return Selection(q, Decision.AVAILABLE, tuple(avoided), counter + fallback + 1)

    q = pick_one_at_least(route, faults, now_ms, counter)
    return Selection(
        q,
        Decision.PICK_ONE_AT_LEAST,
        tuple(b for b in avoided if b != q.broker_name),
        counter + 1,
    )


def rank_brokers(brokers: list[str], faults: Mapping[str, FaultItem], now_ms: int) -> list[str]:
    """Order brokers best first: available, then not found unreachable by the active
    detector, then lower latency, then earlier window end.

    A broker without a fault item ranks as available with latency 0; one the detector
    never checked ranks as reachable, so without the detector this is RocketMQ's order. One
    ``now`` serves the whole sort so the order is consistent (RocketMQ's
    comparator reads the clock per comparison and can violate the contract).
    """

    def key(b: str) -> tuple[bool, bool, int, int, str]:
        item = faults.get(b)
        if item is None:
            return (False, False, 0, 0, b)
        return (
            not item.is_available(now_ms),
            item.reachable is False,
            item.current_latency_ms,
            item.available_at,
            b,
        )

    return sorted(brokers, key=key)


def pick_one_at_least(
    route: Route, faults: Mapping[str, FaultItem], now_ms: int, counter: int
) -> Queue:
    """The least bad queue when every broker is avoided (LatencyFaultToleranceImpl.pickOneAtLeast).

    Ranks the route's brokers that have fault items (all of them when reached
    from ``select``), keeps the better half (``n // 2``, at least one) and walks
    it round-robin with the topic counter: broker ``counter % half``, then that
    broker's queue ``(counter // half) % len(queues)`` so every queue of the
    better half gets an equal share.
    """
    candidates = [b for b in route.by_broker if b in faults] or list(route.by_broker)
    ranked = rank_brokers(candidates, faults, now_ms)
    half = max(1, len(ranked) // 2)
    broker = ranked[counter % half]
    queues = route.by_broker[broker]
    return queues[(counter // half) % len(queues)]
