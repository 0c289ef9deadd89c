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


@dataclass(frozen=True, slots=True)
class Config:
    """One deployment's fault-strategy settings; every replica uses the same one."""

    send_latency_fault_enable: bool = True
    latency_max: tuple[int, ...] = DEFAULT_LATENCY_MAX
    not_available_duration: tuple[int, ...] = DEFAULT_NOT_AVAILABLE_DURATION
    isolation_latency_ms: int = 30000
    last_report_wins: bool = False

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
