"""Reports applied to a replica's own copy of the table (``detour.apply``, the one rule):
the memory store's only path, and the Redis store's while Redis is unreachable."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from detour import policy
from detour.apply import Applied, Effect, EndedIndex, ReportIn, Rules, apply_reports
from detour.model import Config, FaultItem
from detour.view import TableView
from service.errors import TableFull
from service.store.base import ReportOutcome


def outcome(
    r: ReportIn, e: Effect, now_ms: int, config: Config, degraded: bool = False
) -> ReportOutcome:
    """What a report's answer says, from what the rule did (``Effect``)."""
    return ReportOutcome(
        r.broker_name,
        r.latency_ms,
        e.duration_ms,
        now_ms if e.item is None else e.item.available_at,
        now_ms,
        r.isolation,
        None if e.tier is None else config.latency_max[e.tier],
        e.change,
        degraded,
        e.quorum,
        e.reporters,
        e.probe,
        pending=r.pending,
    )


def jitter_rolls(config: Config, n: int) -> list[int]:
    """One jitter draw per report (jitterPercent), none when jitter is off."""
    if not config.jitter_percent:
        return []
    return [random.randrange(policy.JITTER_SCALE) for _ in range(n)]


def apply_locally(
    view: TableView,
    reports: Sequence[ReportIn],
    now_ms: int,
    cap: int,
    drop: Callable[[str], None],
    write: Callable[[FaultItem], None],
    namespace: str,
    ended: EndedIndex | None = None,
) -> Applied:
    """Apply ``reports`` to ``view``'s table with the one rule: ``drop`` each item evicted
    to make room, ``write`` each item a report created or changed, in order.

    Raises TableFull (nothing applied) when open windows fill the table.
    """
    applied = apply_reports(
        view.faults,
        reports,
        now_ms,
        Rules(view.config, cap),
        jitter_rolls(view.config, len(reports)),
        ended,
    )
    for broker in applied.evicted:
        drop(broker)
    if applied.full:
        raise TableFull(namespace, cap)
    for e in applied.effects:
        if e.written and e.item is not None:
            write(e.item)
    return applied
