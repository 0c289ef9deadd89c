"""The storage interface every backend implements, and what a report returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from service.model import Config, FaultItem, Route
from service.strategy import WindowChange
from service.view import TableView


@dataclass(frozen=True, slots=True)
class ReportIn:
    """One report as a producer made it; ``age_ms`` > 0 for a report replayed late."""

    broker_name: str
    latency_ms: int
    isolation: bool = False
    #: how long before the store's ``now`` the send completed (replayed reports)
    age_ms: int = 0
    #: who reported (for the latency log); "" when not given
    producer: str = ""


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


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One report in the latency log."""

    id: str
    broker_name: str
    latency_ms: int
    isolation: bool
    producer: str
    #: when the send completed, epoch ms on the store's clock
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

    async def latency_log(self, after: str | None, limit: int) -> list[LogEntry]:
        """Log entries after id ``after`` (from the oldest kept when None), oldest first."""
        ...

    async def fault_items(self) -> tuple[int, list[FaultItem]]:
        """``(now ms, items)`` read from the store itself, not from the view."""
        ...

    async def delete_fault(self, broker: str) -> bool: ...

    async def put_route(self, route: Route) -> None: ...

    async def delete_route(self, topic: str) -> bool: ...

    async def put_config(self, config: Config) -> None: ...
