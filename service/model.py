"""Value objects shared by the fault strategy, the stores and the API: immutable, no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

#: The longest latency accepted, ms: an hour. Anything above is a clock bug, not a send.
MAX_LATENCY_MS = 3_600_000
#: The longest avoidance window a config may set, ms: a day.
MAX_WINDOW_MS = 86_400_000
#: The oldest a replayed report may be: older ones cannot open a window that is still open.
MAX_REPORT_AGE_MS = MAX_WINDOW_MS

#: RocketMQ's MQFaultStrategy defaults (client 4.x, unchanged in 5.x).
DEFAULT_LATENCY_MAX: tuple[int, ...] = (50, 100, 550, 1000, 2000, 3000, 15000)
DEFAULT_NOT_AVAILABLE_DURATION: tuple[int, ...] = (0, 0, 30000, 60000, 120000, 180000, 600000)

#: How a select chooses among available queues (docs/policy.md).
SELECTIONS = ("round_robin", "p2c-ewma")
#: What a keyed (ordered) select does when the key's queue is on an avoided broker.
ORDERED_FALLBACKS = ("wait", "remap")
#: Most distinct producers a quorum may ask for.
MAX_QUORUM = 64


@dataclass(frozen=True, slots=True)
class Config:
    """One deployment's fault-strategy settings; every replica uses the same one."""

    send_latency_fault_enable: bool = True
    latency_max: tuple[int, ...] = DEFAULT_LATENCY_MAX
    not_available_duration: tuple[int, ...] = DEFAULT_NOT_AVAILABLE_DURATION
    isolation_latency_ms: int = 30000
    last_report_wins: bool = False
    # -- policy beyond RocketMQ (docs/policy.md); the defaults are RocketMQ's behaviour --
    #: "round_robin" (RocketMQ) or "p2c-ewma" (power of two choices on peak-EWMA latency).
    selection: str = "round_robin"
    #: keyed selects whose queue is on an avoided broker: "wait" (keep it) or "remap".
    ordered_fallback: str = "wait"
    #: never avoid more than this share of a route's brokers at once (Envoy max_ejection_percent).
    max_avoided_percent: int = 100
    #: below this share of available brokers, ignore avoidance (Envoy panic threshold); 0 = off.
    panic_threshold_percent: int = 0
    #: share of selects that obey open windows; below 100 the rest only count them (dry run).
    enforcement_percent: int = 100
    #: distinct producers whose failures it takes to isolate a broker for everyone.
    isolation_quorum: int = 1
    #: how recent (ms) a producer's failure must be to count toward the quorum.
    quorum_window_ms: int = 60000
    #: multiply a failure's window by the broker's recent isolation count (Envoy/gRPC backoff).
    repeat_multiplier: bool = False
    #: cap (ms) on a multiplied isolation window (Envoy max_ejection_time).
    max_isolation_ms: int = 3_600_000
    #: a broker's isolation count drops by one per this many healthy ms after its window.
    repeat_decay_ms: int = 600000
    #: isolation windows are lengthened by up to this share, at random, so they do not end together.
    jitter_percent: int = 0
    #: a broker whose window ends gets one select (the probe) before it is open to all again.
    probe_on_expiry: bool = False
    #: how long (ms) a probe may go unreported before another select is given one.
    probe_timeout_ms: int = 10000
    #: TCP-connect to avoided brokers with an address and record whether they answer.
    detector_enable: bool = False
    #: ms between two detector rounds (RocketMQ 5's detectInterval).
    detect_interval_ms: int = 2000
    #: ms a detector connect may take before the broker counts as unreachable.
    detect_timeout_ms: int = 200

    def __post_init__(self) -> None:
        # The API validates with field names; this guards programmatic callers.
        n = len(self.latency_max)
        if not 1 <= n <= 32 or len(self.not_available_duration) != n:
            raise ValueError("latency_max and not_available_duration need the same length, 1..32")
        if any(b <= a for a, b in zip(self.latency_max, self.latency_max[1:], strict=False)):
            raise ValueError("latency_max must be strictly increasing")
        if min(self.latency_max) < 0 or min(self.not_available_duration) < 0:
            raise ValueError("tiers must be >= 0")
        if self.isolation_latency_ms < 0:
            raise ValueError("isolation_latency_ms must be >= 0")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}")
        if self.ordered_fallback not in ORDERED_FALLBACKS:
            raise ValueError(f"ordered_fallback must be one of {ORDERED_FALLBACKS}")
        for name in ("max_avoided_percent", "panic_threshold_percent", "enforcement_percent"):
            if not 0 <= getattr(self, name) <= 100:
                raise ValueError(f"{name} must be 0..100")
        if not 1 <= self.isolation_quorum <= MAX_QUORUM:
            raise ValueError(f"isolation_quorum must be 1..{MAX_QUORUM}")
        for name in ("quorum_window_ms", "repeat_decay_ms", "max_isolation_ms", "probe_timeout_ms"):
            if not 1 <= getattr(self, name) <= MAX_WINDOW_MS:
                raise ValueError(f"{name} must be 1..{MAX_WINDOW_MS}")
        if not 100 <= self.detect_interval_ms <= 3_600_000:
            raise ValueError("detect_interval_ms must be 100..3600000")
        if not 1 <= self.detect_timeout_ms <= 60_000:
            raise ValueError("detect_timeout_ms must be 1..60000")
        if not 0 <= self.jitter_percent <= 100:
            raise ValueError("jitter_percent must be 0..100")


@dataclass(frozen=True, slots=True)
class Queue:
    """One message queue of a topic: RocketMQ's MessageQueue without the topic."""

    broker_name: str
    queue_id: int


@dataclass(frozen=True, slots=True)
class BrokerRoute:
    """A broker's part of a registered route, as an operator declares it."""

    broker_name: str
    write_queue_nums: int
    address: str | None = None


@dataclass(frozen=True, slots=True)
class FaultItem:
    """A broker's entry in the fault table (RocketMQ's FaultItem).

    ``available_at`` is the end of the avoidance window in epoch ms; RocketMQ
    calls it ``startTimestamp`` (the time the broker becomes usable again).
    """

    broker_name: str
    current_latency_ms: int
    available_at: int
    #: recent isolations (the backoff multiplier's count), 0 unless repeatMultiplier is on
    isolations: int = 0
    #: producers whose failure is short of the isolation quorum, with when each failed (ms);
    #: each avoids the broker on its own until its failure's window would have ended
    suspects: tuple[tuple[str, int], ...] = ()
    #: on probation (probeOnExpiry): once the window ends, only a probe is sent until a
    #: successful report re-opens the broker to all
    probation: bool = False
    #: the active detector's last reading: True (a TCP connect succeeded), False (refused or
    #: timed out), None (never checked); pickOneAtLeast prefers reachable brokers
    reachable: bool | None = None

    def is_available(self, now_ms: int) -> bool:
        return now_ms >= self.available_at


@dataclass(frozen=True)
class Route:
    """A topic's queues in selection order: by broker name, then queue id.

    Derived lookups are computed once here because ``select`` runs on every
    request and must not rebuild them.
    """

    topic: str
    queues: tuple[Queue, ...]
    addresses: Mapping[str, str | None]
    by_broker: Mapping[str, tuple[Queue, ...]] = field(init=False, repr=False, compare=False)
    #: run_end[i]: index one past the last queue of queues[i]'s broker run.
    run_end: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        grouped: dict[str, list[Queue]] = {}
        for q in self.queues:
            grouped.setdefault(q.broker_name, []).append(q)
        run_end: list[int] = [0] * len(self.queues)
        i = 0
        while i < len(self.queues):
            j = i
            while j < len(self.queues) and self.queues[j].broker_name == self.queues[i].broker_name:
                j += 1
            for k in range(i, j):
                run_end[k] = j
            i = j
        object.__setattr__(
            self, "by_broker", MappingProxyType({b: tuple(qs) for b, qs in grouped.items()})
        )
        object.__setattr__(self, "run_end", tuple(run_end))

    @classmethod
    def from_brokers(cls, topic: str, brokers: Iterable[BrokerRoute]) -> Route:
        ordered = sorted(brokers, key=lambda b: b.broker_name)
        queues = tuple(
            Queue(b.broker_name, qid) for b in ordered for qid in range(b.write_queue_nums)
        )
        return cls(topic, queues, MappingProxyType({b.broker_name: b.address for b in ordered}))

    @classmethod
    def from_queues(cls, topic: str, queues: Iterable[Queue]) -> Route:
        """An ad-hoc route from a select's inline queue list (no addresses)."""
        ordered = tuple(sorted(set(queues), key=lambda q: (q.broker_name, q.queue_id)))
        return cls(topic, ordered, MappingProxyType({q.broker_name: None for q in ordered}))


def route_brokers(route: Route) -> tuple[BrokerRoute, ...]:
    """A registered route's brokers back from its queue list."""
    return tuple(
        BrokerRoute(b, len(qs), route.addresses.get(b)) for b, qs in route.by_broker.items()
    )
