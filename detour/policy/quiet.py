"""Which reports a replica may keep local: those that can change nothing another replica
must see (docs/semantics.md, "What is shared")."""

from __future__ import annotations

from detour import strategy
from detour.model import Config, FaultItem


def quiet(
    old: FaultItem | None,
    latency_ms: int,
    isolation: bool,
    at_ms: int,
    config: Config,
    pending: bool = False,
) -> bool:
    """Whether a report can change nothing another replica must see, whatever the table in
    the store holds beyond this replica's copy ``old`` (stale by at most one push).

    Such a report only refreshes ``currentLatencyMs`` and the latency log, which a replica
    sums locally and flushes (docs/semantics.md). The rule leans one way: a report kept
    local can never have opened, extended or ended a window, nor voted, so no window is
    lost or shortened by keeping it.

    - a failure, or a latency in a tier with a window, always goes to the store (it may
      open or extend a window, or vote);
    - a broker the copy does not hold goes (it creates the item; the table's cap is the
      store's to enforce);
    - a broker on probation goes (a success may pass the probe);
    - with ``lastReportWins`` a report over a window open at its time goes (it ends the
      window), and so does one for a broker with slow votes (``latencyQuorum``: it may end
      its producer's own window, as it would in that producer's RocketMQ table). A window
      the copy does not know yet is not ended by a report kept local:
      it stays until the next report after the push, longer, never shorter;
    - a pending report goes, and so does any report for a broker with an open in-flight
      signal (``pendingQuorum``: a completed send withdraws its producer's);
    - with the ``extend`` rule a zero-length report leaves every window as it is
      (``max(old end, at)``), whatever the store holds: it never needs the store.
    """
    if isolation or pending:
        return False
    if not config.send_latency_fault_enable:
        return True
    if old is None or old.probation:
        return False
    if any(at > 0 for _, _, at in old.pending):
        # a completed send may withdraw its producer's in-flight signal
        return False
    t = strategy.tier(config, latency_ms, False)
    if t is not None and config.not_available_duration[t] > 0:
        return False
    return not (config.last_report_wins and (old.available_at > at_ms or bool(old.slow)))
