"""The SDK's value objects: what a select returns, what a send did, what a report says.

Frozen dataclasses so results can be shared between threads and kept in logs
without anyone changing them afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from detour.strategy import Decision

#: ``remote``: every select asks Detour; ``cached``: selects are decided in-process from a
#: replica of the table that ``GET /fault-items/stream`` keeps current.
Mode = Literal["remote", "cached"]

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class SelectedQueue:
    """The queue one send attempt should go to.

    ``local`` is True when the client decided in-process (cached mode, or Detour
    was unavailable and the client failed open) rather than Detour answering.
    """

    topic: str
    broker_name: str
    queue_id: int
    #: the broker's ``host:port`` from the route, when registered.
    address: str | None
    decision: Decision
    #: brokers passed over because their window is open, in the order met.
    avoided_brokers: tuple[str, ...]
    local: bool
    #: the rest of ``POST /select``'s answer (docs/policy.md): too few brokers were
    #: available and avoidance was ignored (``panicThresholdPercent``) ...
    panic: bool = False
    #: ... open windows were counted but not obeyed (``enforcementPercent``) ...
    dry_run: bool = False
    #: ... brokers with an open window this select did not avoid ...
    unenforced_brokers: tuple[str, ...] = ()
    #: ... ``home``, ``wait`` or ``remap`` for a select with a sharding key, else None ...
    ordered: str | None = None
    #: ... and whether this select is the probe for a broker on probation: report it.
    probe: bool = False


@dataclass(frozen=True, slots=True)
class Report:
    """One send's outcome for ``report_batch``.

    ``latency_ms`` is the send's duration in ms (0..3,600,000, fractions truncated by
    Detour); ``isolation`` marks a failed send; ``age_ms`` says how long ago the send
    completed (0 = just now).
    """

    broker_name: str
    latency_ms: float
    isolation: bool = False
    age_ms: int = 0


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt of a send: where it went, how long ``deliver`` took (ms), what it raised."""

    queue: SelectedQueue
    latency_ms: float
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class SendResult(Generic[R]):
    """A delivered message: the queue that took it, every attempt (the last one succeeded)
    and what ``deliver`` returned for it."""

    queue: SelectedQueue
    attempts: list[Attempt] = field(default_factory=list)
    value: R | None = None


@dataclass(frozen=True, slots=True)
class ClientStats:
    """Counters for dashboards and tests; a snapshot, not live."""

    mode: Mode
    #: selects Detour answered / decided in-process.
    remote_selects: int
    local_selects: int
    #: calls to Detour that failed open: timed out (whole call, headers and body), failed
    #: to connect, 5xx or 429, and the rejected and bad answers counted below.
    detour_failures: int
    #: reports waiting to be sent (including a batch in flight).
    pending_reports: int
    #: reports dropped: the queue was full (oldest first), Detour refused them with its own
    #: 4xx (from ``send``, ``report``, ``report_batch`` or the flusher), or the client closed
    #: with them unsent.
    dropped_reports: int
    #: reports Detour accepted.
    sent_reports: int
    #: cached mode: the event stream is connected and has delivered a snapshot.
    stream_connected: bool
    #: cached mode: estimated service clock minus local monotonic clock, ms. None in remote
    #: mode, which has no such estimate: its local table runs on the process wall clock.
    clock_offset_ms: float | None
    #: calls (and stream connections) answered 401, 403 or a 3xx: a token or URL to fix; the
    #: client decided locally meanwhile and logged it at ERROR (at most once a minute).
    rejected_calls: int = 0
    #: the status of the last of those, None if there was none.
    last_rejected_status: int | None = None
    #: answers that were not Detour's (a 2xx of the wrong shape, not JSON or over 4 MiB, or
    #: naming a queue the route does not have; a 4xx without Detour's error body, such as a
    #: proxy's page): decided locally as well.
    bad_answers: int = 0
    #: cached mode: stream connections dropped (and reconnected) because a line or an event
    #: was longer than ``max_event_bytes``.
    stream_too_large: int = 0
    #: remote mode: selects and reports Detour had not answered by the decision deadline
    #: (``decide_within``): decided locally (the report queued if it then failed) while the
    #: call went on, its answer still teaching the local table.
    late_answers: int = 0
    #: reports not sent again because their ``reportId`` was made longer ago than Detour
    #: remembers ids (15 minutes less a minute's margin), or that Detour declined as
    #: ``expired``: a replay then could be applied twice. Not in ``dropped_reports``.
    expired_reports: int = 0
    #: cached mode: snapshots the event stream applied: the first, then one per reconnect
    #: (many in a minute: the stream keeps breaking, and each snapshot costs both sides).
    stream_snapshots: int = 0
