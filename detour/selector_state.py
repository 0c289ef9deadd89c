"""What this replica's selects remember on their own: round-robin counters, latency scores, probes.

None of it is shared or versioned (that is ``detour.view.TableView``'s table copy):
each replica keeps its own, as each RocketMQ producer does, and losing any of it
is harmless (a counter restarts at a random position, a score falls back to the
table's latency, a probe is handed out again). That is what lets every map here be
bounded by names a client chooses without any say from the store:

* topic counters: an LRU of ``max_topics`` topics (inline-queue topics are never
  dropped by anything else), and dropped with the topic's route;
* peak-EWMA scores: dropped with the broker's fault item, and an LRU of
  ``max_brokers`` brokers for those reported without one;
* probes: dropped with the broker's fault item, so never more than the table holds.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

from detour.model import Config, FaultItem
from detour.policy import idle_score, peak_ewma, probe_free

#: Only a counter's value modulo small route sizes matters.
COUNTER_MASK = 0x7FFFFFFF


class SelectorState:
    """Per-topic counters and per-broker scores and probes, each map bounded (LRU)."""

    def __init__(self, max_topics: int = 10_000, max_brokers: int = 10_000) -> None:
        #: Topics whose counter is kept; the least recently selected goes first.
        self.max_topics = max_topics
        #: Brokers whose EWMA score is kept; the least recently reported goes first.
        self.max_brokers = max_brokers
        # Plain dicts used as LRUs: a use moves the key to the end (delete, insert),
        # so the first key is the least recently used. Cheaper than an OrderedDict on
        # the select path.
        #: topic -> counter. Public for one writer besides these methods: a select answered
        #: from a kept answer (``detour.selector.choose_kept``) steps a counter that exists,
        #: in place and moved to the end as ``set_counter`` does, without a call of its own.
        self.counters: dict[str, int] = {}
        #: peak-EWMA latency (ms) and when it was last updated, per broker.
        self._ewma: dict[str, tuple[float, int]] = {}
        #: broker -> (window end, when) of the last probe this replica handed out
        self._probes: dict[str, tuple[int, int]] = {}

    def sizes(self) -> tuple[int, int, int]:
        """(topic counters, EWMA scores, probes) held now: what the bounds hold down."""
        return len(self.counters), len(self._ewma), len(self._probes)

    # -- round robin -------------------------------------------------------
    def counter(self, topic: str) -> int:
        """The topic's round-robin position (a random start, as RocketMQ's per-thread
        index, so replicas starting together do not all pick the same first queue)."""
        c = self.counters.get(topic)
        if c is None:
            c = random.randrange(1 << 16)
            self._store_counter(topic, c)
        return c

    def set_counter(self, topic: str, value: int) -> None:
        counters = self.counters
        if topic in counters:
            del counters[topic]  # to the end: most recently used
        self._store_counter(topic, value & COUNTER_MASK)

    def _store_counter(self, topic: str, value: int) -> None:
        counters = self.counters
        counters[topic] = value
        if len(counters) > self.max_topics:
            del counters[next(iter(counters))]

    def forget_topic(self, topic: str) -> None:
        """The topic's route was deleted."""
        self.counters.pop(topic, None)

    # -- latency scores ----------------------------------------------------
    def observe_latency(self, broker: str, latency_ms: int, now_ms: int) -> None:
        """Fold one reported latency into the broker's peak EWMA."""
        ewma = self._ewma
        old = ewma.pop(broker, None)
        if old is None:
            value = float(latency_ms)
        else:
            # From the score selects saw (faded while idle), so a broker tried again after
            # a pause is judged by what it does now, not by its old peak.
            seen = idle_score(old[0], old[1], now_ms)
            value = peak_ewma(seen, old[1], latency_ms, now_ms)
        ewma[broker] = (value, now_ms)
        if len(ewma) > self.max_brokers:
            del ewma[next(iter(ewma))]

    def latency_scores(self, faults: Mapping[str, FaultItem], now_ms: int) -> dict[str, float]:
        """Each broker's score: its peak EWMA here, else the table's latency."""
        scores = {b: float(i.current_latency_ms) for b, i in faults.items()}
        scores.update({b: idle_score(v, at, now_ms) for b, (v, at) in self._ewma.items()})
        return scores

    # -- probation probes --------------------------------------------------
    def free_probes(self, faults: Mapping[str, FaultItem], config: Config, now_ms: int) -> set[str]:
        return {
            b for b, item in faults.items() if probe_free(item, now_ms, config, self._probes.get(b))
        }

    def probe_sent(self, item: FaultItem, now_ms: int) -> None:
        self._probes[item.broker_name] = (item.available_at, now_ms)

    # -- dropped with their item -------------------------------------------
    def forget_broker(self, broker: str) -> None:
        """The broker's fault item left the table: its score and probe go with it."""
        self._ewma.pop(broker, None)
        self._probes.pop(broker, None)

    def forget_brokers(self, brokers: Iterable[str]) -> None:
        for broker in brokers:
            self.forget_broker(broker)
