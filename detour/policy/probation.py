"""Probation: a broker whose window ended waits for one probe send to succeed before every
select may have it again (probeOnExpiry, earlyRecovery)."""

from __future__ import annotations

from detour.model import Config, FaultItem


def probation_on(config: Config) -> bool:
    """Whether a broker's probation flag is obeyed: probeOnExpiry, or earlyRecovery (which
    puts a broker the detector found back on probation before its window ends)."""
    return config.probe_on_expiry or config.early_recovery


def on_probation(item: FaultItem, now_ms: int, config: Config) -> bool:
    """The broker's window has ended but it waits for a probe to succeed (probeOnExpiry,
    or earlyRecovery's early probation)."""
    return probation_on(config) and item.probation and now_ms >= item.available_at


def probe_free(
    item: FaultItem, now_ms: int, config: Config, handed: tuple[int, int] | None
) -> bool:
    """Whether a select may be the probe for this broker now.

    ``handed`` is (window end, when) of the last probe this replica gave for the
    broker: one probe per window end, another only after ``probeTimeoutMs`` went by
    without a report deciding it (the probe's send was lost or never reported).
    """
    if not on_probation(item, now_ms, config):
        return False
    if handed is None or handed[0] != item.available_at:
        return True
    return now_ms - handed[1] >= config.probe_timeout_ms
