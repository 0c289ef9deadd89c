"""Repeat-offender backoff and jitter: a failure's window grows with the broker's recent
isolations (repeatMultiplier) and is lengthened by a random share (jitterPercent)."""

from __future__ import annotations

from detour.model import Config, FaultItem

#: The jitter roll's range: report.lua receives integers 0..JITTER_SCALE-1 (small enough
#: that Lua's double arithmetic floors the jitter exactly as Python's integers do).
JITTER_SCALE = 10_000
#: The isolation count stops rising here (the window is capped long before).
MAX_ISOLATIONS = 1000


def backoff(
    config: Config, base_ms: int, old: FaultItem | None, at_ms: int, jitter_roll: int
) -> tuple[int, int]:
    """(window length ms, isolation count after) for a failure at ``at_ms``.

    With ``repeatMultiplier`` off the count stays 0 and the length is ``base_ms``.
    On: the count drops by one per ``repeatDecayMs`` the broker was healthy since
    its last window ended, then rises by one when this failure opens a new window
    (a failure inside an open window keeps the count, as Envoy counts ejections,
    not errors); the length is ``base_ms * count``, capped at ``maxIsolationMs``
    but never below ``base_ms``. Jitter adds ``length * jitterPercent% *
    jitter_roll / JITTER_SCALE`` (``jitter_roll`` in 0..JITTER_SCALE-1), so many
    brokers isolated together do not come back together.
    """
    count = 0
    length = base_ms
    if config.repeat_multiplier and base_ms > 0:
        prev = old.isolations if old is not None else 0
        opens = old is None or old.available_at <= at_ms
        if opens:
            if old is not None and prev:
                prev = max(0, prev - (at_ms - old.available_at) // config.repeat_decay_ms)
            count = min(prev + 1, MAX_ISOLATIONS)
        else:
            count = max(prev, 1)
        length = max(base_ms, min(base_ms * count, config.max_isolation_ms))
    if config.jitter_percent and length > 0:
        length += length * config.jitter_percent * jitter_roll // (100 * JITTER_SCALE)
    return length, count
