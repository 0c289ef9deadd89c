"""The one report rule (detour.apply) called as the policy tests call it: one report at
``at_ms``, applied at ``now_ms``."""

from __future__ import annotations

from detour.apply import Effect, ReportIn, apply_one
from detour.model import Config, FaultItem


def applied(
    old: FaultItem | None,
    broker: str,
    latency_ms: int,
    isolation: bool,
    origin: str | None,
    producer: str,
    at_ms: int,
    now_ms: int,
    config: Config,
    jitter_roll: int = 0,
    pending: bool = False,
) -> Effect:
    report = ReportIn(
        broker, latency_ms, isolation, now_ms - at_ms, producer, origin, pending=pending
    )
    return apply_one(old, report, now_ms, config, jitter_roll)
