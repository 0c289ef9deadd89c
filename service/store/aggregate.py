"""The reports a replica keeps local (policy.quiet): summed per broker until the next flush.

Why: at fleet scale one Redis write per send is the whole load of the namespace's one hash
slot, while most reports change nothing another replica must see. What they do carry is
the broker's latest latency (``currentLatencyMs``, which ranks brokers in
``pickOneAtLeast``) and the latency log's sample. Both are summed here and written once
per broker per flush interval, as one entry of report.lua's call with this replica's next
sequence number (so a flush retried after a timeout is applied once). docs/semantics.md.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field

from detour.model import LATENCY_BUCKETS


def bucket_of(latency_ms: int) -> int:
    """Index into ``LATENCY_BUCKETS`` of the bucket holding ``latency_ms``."""
    return max(0, bisect.bisect_right(LATENCY_BUCKETS, latency_ms) - 1)


@dataclass(slots=True)
class Summary:
    """One broker's quiet reports of one interval, as report.lua's summary entry takes it."""

    broker: str
    #: the producer the reports named ("" = none): the log keeps who sent
    producer: str
    #: the latest report's latency and time (store clock, epoch ms)
    latency_ms: int
    at_ms: int
    #: the first report's time: the interval the histogram covers is [since_ms, at_ms]
    since_ms: int
    #: reports per bucket of LATENCY_BUCKETS (trailing zeros left out on the wire)
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    #: this replica's sequence number: the summary's identity (0 until it is flushed)
    seq: int = 0
    #: arrival order of the latest report (ties of ``at_ms`` between producers)
    order: int = 0

    def add(self, latency_ms: int, at_ms: int, order: int) -> None:
        self.counts[bucket_of(latency_ms)] += 1
        if at_ms >= self.at_ms:
            self.latency_ms, self.at_ms, self.order = latency_ms, at_ms, order
        self.since_ms = min(self.since_ms, at_ms)

    def wire_counts(self) -> str:
        """The histogram as report.lua logs it: counts joined by ",", trailing zeros cut."""
        last = max((i for i, c in enumerate(self.counts) if c), default=-1)
        return ",".join(str(c) for c in self.counts[: last + 1])


class Aggregate:
    """Summaries per broker and producer, at most ``cap`` of them (a report beyond it is
    sent to the store at once)."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._by_broker: dict[tuple[str, str], Summary] = {}
        #: reports summed since the last take (for the flush's metric)
        self.reports = 0

    def __len__(self) -> int:
        return len(self._by_broker)

    def has_room(self, broker: str, producer: str) -> bool:
        """Whether ``add`` would take a report for this broker and producer."""
        return (broker, producer) in self._by_broker or len(self._by_broker) < self._cap

    def add(self, broker: str, producer: str, latency_ms: int, at_ms: int) -> bool:
        """Sum one quiet report; False when the bound is reached (send it instead)."""
        key = (broker, producer)
        s = self._by_broker.get(key)
        if s is None:
            if len(self._by_broker) >= self._cap:
                return False
            s = self._by_broker[key] = Summary(broker, producer, latency_ms, at_ms, at_ms)
        self.reports += 1
        s.add(latency_ms, at_ms, self.reports)
        return True

    def written(self, broker: str, at_ms: int) -> None:
        """A report at ``at_ms`` wrote the broker's latency in the store: a summed latest
        latency older than it must not overwrite it at the flush (its histogram stays)."""
        for (b, _), s in self._by_broker.items():
            if b == broker and s.at_ms <= at_ms:
                s.latency_ms = -1

    def take(self) -> list[Summary]:
        """The summaries, oldest latest report first (the store keeps the last latency it
        is given for a broker: the newest)."""
        out = sorted(self._by_broker.values(), key=lambda s: (s.at_ms, s.order))
        self._by_broker = {}
        self.reports = 0
        return out


class RecentIds:
    """Report ids this replica answered without the store, for ``window_ms`` and at most
    ``cap`` of them: a producer's retry to the same replica is answered as a duplicate."""

    def __init__(self, window_ms: int, cap: int) -> None:
        self._window_ms, self._cap = window_ms, cap
        self._ids: OrderedDict[str, int] = OrderedDict()

    def seen(self, report_id: str, now_ms: int) -> bool:
        """True when ``report_id`` was taken already; else it is taken now."""
        ids = self._ids
        for _ in range(8):  # bounded pruning per call; the cap bounds the rest
            if not ids:
                break
            oldest, at = next(iter(ids.items()))
            if at > now_ms - self._window_ms:
                break
            del ids[oldest]
        if report_id in ids:
            return True
        ids[report_id] = now_ms
        while len(ids) > self._cap:
            ids.popitem(last=False)
        return False
