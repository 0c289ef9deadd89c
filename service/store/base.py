"""The storage interface every backend implements, and what a report returns."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from detour.apply import ReportIn as ReportIn
from detour.model import REPORT_ID_CAP as REPORT_ID_CAP
from detour.model import REPORT_ID_MARGIN_MS as REPORT_ID_MARGIN_MS
from detour.model import REPORT_ID_WINDOW_MS as REPORT_ID_WINDOW_MS
from detour.model import Config, FaultItem, Route
from detour.strategy import WindowChange
from detour.view import TableView


@dataclass(frozen=True, slots=True)
class ReportOutcome:
    broker_name: str
    latency_ms: int
    #: window length this report asked for (0 when avoidance is off)
    not_available_duration_ms: int
    #: the broker's window end after the update, epoch ms on the store's clock
    available_at: int
    now_ms: int
    isolation: bool = False
    #: the latencyMax (ms) of the tier the report fell in, with the config it was applied
    #: with (None: below every tier, or avoidance off)
    tier_ms: int | None = None
    change: WindowChange = WindowChange.NONE
    #: taken into the local journal because the store did not answer
    degraded: bool = False
    #: a failure subject to the isolation quorum: "suspected" (short of it) or "reached"
    quorum: str | None = None
    #: producers behind the report: the quorum's voters when it was reached, else 1
    reporters: int = 1
    #: a report on a broker on probation: "passed", "failed" or None (detour.apply.Effect)
    probe: str | None = None
    #: the report's identity had been applied already: nothing changed
    duplicate: bool = False
    #: the report's identity is one its scope's id memory may have forgotten (dated before
    #: its horizon, ``ReportIds.horizon``): not applied, so never applied twice
    expired: bool = False
    #: an in-flight signal (ReportIn.pending)
    pending: bool = False


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One report in the latency log."""

    id: str
    broker_name: str
    latency_ms: int
    isolation: bool
    producer: str
    #: when the send completed, epoch ms on the store's clock (a histogram: the latest's)
    at: int
    #: a histogram entry: one replica's reports of ``producer`` that changed no window, per
    #: bucket of ``model.LATENCY_BUCKETS``, sent in [since, at]; latency_ms is -1
    #: (docs/semantics.md). None: one report.
    histogram: tuple[int, ...] | None = None
    since: int | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of the event log: a window opened, extended, ended early or reached by quorum."""

    id: str
    #: "opened", "extended", "ended" or "quorum" (detour.policy.window_event)
    kind: str
    #: "isolation", "latency", "quorum", "success" or "operator"
    reason: str
    broker_name: str
    #: the tier's latencyMax (ms) the window came from, None when none applies
    tier_ms: int | None
    #: producers behind it: the quorum's voters, 1 for one report, 0 for an operator
    reporters: int
    #: the window end after the event, epoch ms (``at`` when it ended)
    available_at: int
    #: when it happened, epoch ms on the store's clock
    at: int


class FaultStore(Protocol):
    """The shared fault table.

    Reads for /select go to ``view`` (this replica's copy, never a round trip);
    every write is one atomic operation on the store and is reflected in
    ``view`` before the call returns. Methods raise ``StoreUnavailable`` when the
    backing store does not answer.
    """

    kind: str
    namespace: str
    view: TableView

    @property
    def degraded(self) -> bool:
        """Answering from this replica's copy because the store is unreachable."""
        ...

    @property
    def journal_size(self) -> int:
        """Reports accepted but not yet in the store."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def ping(self) -> None: ...

    async def report_many(self, reports: Sequence[ReportIn]) -> list[ReportOutcome]:
        """Apply reports in order, all at once (one atomic store operation)."""
        ...

    def report_now(self, reports: Sequence[ReportIn]) -> list[ReportOutcome] | None:
        """``report_many``'s outcomes when the store can apply them without waiting for
        I/O (the memory table; reports a Redis replica keeps local), or None, having
        changed nothing: the caller then awaits ``report_many``. The server answers the
        first kind in the loop turn that read the request (service/edge/direct.py)."""
        ...

    async def latency_log(self, after: str | None, limit: int) -> list[LogEntry]:
        """Log entries after id ``after`` (from the oldest kept when None), oldest first."""
        ...

    async def events(self, since: str | None, limit: int, latest: bool = False) -> list[Event]:
        """Event log entries after id ``since`` (from the oldest kept when None), oldest first;
        ``latest``: the newest ``limit`` entries instead (``since`` ignored), oldest first."""
        ...

    async def fault_items(self) -> tuple[int, list[FaultItem]]:
        """``(now ms, items)`` read from the store itself, not from the view."""
        ...

    async def delete_fault(self, broker: str) -> bool: ...

    async def detector_lease(self, ttl_ms: int) -> bool:
        """Take or renew the active detector's lease: True while this replica holds it."""
        ...

    async def set_reachability(self, readings: Mapping[str, bool]) -> None:
        """Record the detector's readings on the brokers' fault items (brokers without
        one are skipped); a changed reading is pushed like a window change."""
        ...

    async def put_route(self, route: Route) -> None: ...

    async def delete_route(self, topic: str) -> bool: ...

    async def put_config(self, config: Config) -> None:
        """Replace the config whole."""
        ...

    async def patch_config(self, update: Callable[[Config], Config]) -> Config:
        """Change the config by ``update`` (called on the config as the store holds it, and
        again if another write came first), atomically; returns the config written.
        Whatever ``update`` raises propagates, nothing written."""
        ...
