"""One report applied to a replica's own copy of the table: the memory store's only path,
and the Redis store's while Redis is unreachable."""

from __future__ import annotations

import random
from collections.abc import Callable

from detour import policy, strategy
from detour.model import FaultItem
from detour.view import TableView
from service.store.base import ReportIn, ReportOutcome


def report_locally(
    view: TableView,
    report: ReportIn,
    now_ms: int,
    write: Callable[[FaultItem], None],
    degraded: bool = False,
) -> ReportOutcome:
    """Compute the new fault item with the view's config, hand it to ``write``, describe it.

    With avoidance off nothing is written (RocketMQ's updateFaultItem does nothing).
    """
    config = view.config
    old = view.faults.get(report.broker_name)
    old_end = old.available_at if old else None
    if not config.send_latency_fault_enable:
        end = now_ms if old_end is None else old_end
        return ReportOutcome(
            report.broker_name,
            report.latency_ms,
            0,
            end,
            now_ms,
            report.isolation,
            degraded=degraded,
        )
    applied = policy.apply(
        old,
        report.broker_name,
        report.latency_ms,
        report.isolation,
        report.origin,
        report.voter_id,
        now_ms - report.age_ms,
        now_ms,
        config,
        random.randrange(policy.JITTER_SCALE) if config.jitter_percent else 0,
        report.pending,
    )
    item, tier = applied.item, applied.tier
    if not report.pending or applied.suspected or applied.quorum_reached:
        # (a pending report that was not recorded changes nothing, creates no item)
        write(item)
    return ReportOutcome(
        report.broker_name,
        report.latency_ms,
        applied.duration_ms,
        item.available_at,
        now_ms,
        report.isolation,
        None if tier is None else config.latency_max[tier],
        strategy.window_change(old_end, item.available_at, now_ms),
        degraded,
        "reached" if applied.quorum_reached else "suspected" if applied.suspected else None,
        applied.reporters,
        applied.probe,
        pending=report.pending,
    )
