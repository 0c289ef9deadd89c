"""The event log's words for what a report did to a window."""

from __future__ import annotations

from detour import strategy


def window_event(
    change: strategy.WindowChange,
    isolation: bool,
    quorum_reached: bool,
    probe: str | None = None,
    pending: bool = False,
) -> tuple[str, str] | None:
    """(kind, reason) of the event a report writes to the event log, or None.

    kinds: ``opened``, ``extended``, ``ended`` (early), ``quorum`` (opened because the
    quorum was reached); reasons: ``isolation`` (a failure), ``latency`` (a slow
    answer), ``quorum``, ``success`` (a report under lastReportWins ended a window).
    An operator's delete is ``("ended", "operator")``, written by the store. A probe:
    ``("ended", "probe")`` when its success re-opened the broker to all (its window had
    ended already, but selects still kept away), ``("opened", "probe")`` when it failed.
    A pending quorum (``pending``): ``("opened"|"extended", "pending")``.
    report.lua derives the same.
    """
    if probe == "passed":
        return "ended", "probe"
    if probe == "failed" and change is strategy.WindowChange.OPENED:
        return "opened", "probe"
    if change is strategy.WindowChange.NONE:
        return None
    if change is strategy.WindowChange.CLEARED:
        return "ended", "success"
    if pending:
        return ("opened" if change is strategy.WindowChange.OPENED else "extended"), "pending"
    if quorum_reached and change is strategy.WindowChange.OPENED:
        return "quorum", "quorum"
    kind = "opened" if change is strategy.WindowChange.OPENED else "extended"
    return kind, "isolation" if isolation else "latency"
