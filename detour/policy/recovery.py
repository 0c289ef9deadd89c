"""Recovery: the staggered return after a window (rampMs) and the active detector's early
return of a broker it found restarted (earlyRecovery)."""

from __future__ import annotations

from dataclasses import replace

from detour.model import Config, FaultItem

#: The staggered return's first share of selects is 1/2**RAMP_STEPS, doubled every
#: rampMs/RAMP_STEPS until it is all of them.
RAMP_STEPS = 6


def ramp_share(item: FaultItem, now_ms: int, config: Config) -> float:
    """The share of selects a broker gets ``now`` (rampMs): 1 inside its window (the window
    decides) and from ``rampMs`` after it ended; in between 1/64, doubling every rampMs/6.

    An item whose end is 0 never had a window (``ramp_end``): full share. Integer steps, so
    every decider computes the same share from the same clock.
    """
    since = now_ms - item.available_at
    if not config.ramp_ms or since < 0 or since >= config.ramp_ms or item.available_at == 0:
        return 1.0
    step = since * RAMP_STEPS // config.ramp_ms
    return float(1 << step) / (1 << RAMP_STEPS)


def ramp_skips(item: FaultItem, now_ms: int, config: Config, roll: float) -> bool:
    """Whether a select whose ramp draw is ``roll`` (uniform in [0, 1)) skips this broker,
    still ramping up after its window: the roll lost (``roll >= share``)."""
    return roll >= ramp_share(item, now_ms, config)


def ramp_end(old: FaultItem | None, end: int, at_ms: int) -> int:
    """The window end a report that opens no window leaves under rampMs: the last window's
    end stays (the ramp counts from it; a healthy report would otherwise move it to the
    report's time and restart the ramp), 0 on a new item (it never had a window). A report
    inside an open window is RocketMQ's (``end``, the rule's)."""
    if old is None:
        return 0
    return old.available_at if old.available_at <= at_ms else end


def reach(item: FaultItem, reachable: bool, now_ms: int, config: Config) -> FaultItem:
    """The item after the active detector's reading (reach.lua implements the same rule).

    The reading is kept (``reachable``). With earlyRecovery, a broker in an open window that
    the detector had found refusing connections (``reachable`` False) and now reaches is
    evidence the broker is back: its window ends now and it goes on probation, so the next
    select probes it (``on_probation``). A first reading never counts (a hung or slow
    process accepts connections too: only a refusal then an accept says it restarted). A
    repeat offender (``isolations`` above 1: repeatMultiplier counted it isolated again
    within repeatDecayMs, e.g. a flapping broker) waits out its window.
    """
    if (
        config.early_recovery
        and config.send_latency_fault_enable
        and reachable
        and item.reachable is False
        and item.isolations <= 1
        and now_ms < item.available_at
    ):
        return replace(item, available_at=now_ms, probation=True, reachable=True, why=None)
    return replace(item, reachable=reachable)
