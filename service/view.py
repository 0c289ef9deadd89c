"""A replica's copy of the shared table: config, routes and fault windows, read by /select.

/select never waits on a store: it reads this view. The memory store writes it
directly; the Redis store keeps it current from pushed changes and resyncs.
Every entry carries the store version it was written at, so a late or
duplicated change can never overwrite a newer one (deletes leave tombstones).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from service.model import Config, FaultItem, Route
from service.policy import idle_score, peak_ewma, probe_free


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The whole table as of one store version."""

    version: int
    config: Config
    config_version: int
    routes: Mapping[str, Route]
    faults: Mapping[str, FaultItem]


ChangeKind = Literal["fault", "route", "config", "snapshot", "stop"]
#: (kind, key, value, version): ("fault", broker, FaultItem | None), ("route", topic,
#: Route | None), ("config", "", Config), ("snapshot", "", None) after a resync replaced
#: everything. version is the store version of the change (0 for a window this replica set
#: on its own while the store was unreachable).
Listener = Callable[[ChangeKind, str, object, int], None]


class TableView:
    def __init__(self, clock: Callable[[], int], namespace: str = "default") -> None:
        #: Epoch ms on the store's clock (Redis TIME for Redis, the process clock for memory).
        self.now_ms = clock
        #: Whose table this is (a label on the metrics it feeds).
        self.namespace = namespace
        self.config = Config()
        #: Store version at which ``config`` was written; reports carry it so a
        #: replica never applies tiers it has not seen yet.
        self.config_version = 0
        self.routes: dict[str, Route] = {}
        self.faults: dict[str, FaultItem] = {}
        #: Highest version applied in sequence (gap detection for pushes).
        self.version = 0
        self._route_v: dict[str, int] = {}
        self._fault_v: dict[str, int] = {}
        self._counters: dict[str, int] = {}
        #: peak-EWMA latency (ms) per broker of the reports this replica handled, for
        #: ``selection: p2c-ewma``; a broker not reported here yet falls back to the table's
        #: currentLatencyMs (see ``latency_scores``).
        self._ewma: dict[str, tuple[float, int]] = {}
        #: broker -> (window end, when) of the last probe this replica handed out
        self._probes: dict[str, tuple[int, int]] = {}
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` after every applied change; returns the unsubscribe function.

        Listeners run inline and must not block (the push stream queues).
        """
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def stop_listeners(self) -> None:
        """Tell every listener the process is stopping (push streams end so clients
        reconnect to another replica at once instead of holding up the shutdown)."""
        self._notify("stop", "", None, self.version)

    def _notify(self, kind: ChangeKind, key: str, value: object, version: int) -> None:
        for listener in tuple(self._listeners):
            listener(kind, key, value, version)

    # -- round robin -------------------------------------------------------
    def counter(self, topic: str) -> int:
        """The topic's round-robin position on this replica.

        Starts at a random value, as RocketMQ's per-thread index does, so many
        replicas starting together do not all send their first message to the
        same queue.
        """
        c = self._counters.get(topic)
        if c is None:
            c = self._counters[topic] = random.randrange(1 << 16)
        return c

    def set_counter(self, topic: str, value: int) -> None:
        # Keep it bounded; only its value modulo small route sizes matters.
        self._counters[topic] = value & 0x7FFFFFFF

    # -- latency scores ----------------------------------------------------
    def observe_latency(self, broker: str, latency_ms: int, now_ms: int) -> None:
        """Fold one reported latency into the broker's peak EWMA (this replica's reports)."""
        old = self._ewma.get(broker)
        if old is None:
            value = float(latency_ms)
        else:
            # From the score selects saw (faded while idle), so a broker tried again after
            # a pause is judged by what it does now, not by its old peak.
            seen = idle_score(old[0], old[1], now_ms)
            value = peak_ewma(seen, old[1], latency_ms, now_ms)
        self._ewma[broker] = (value, now_ms)

    @property
    def latency_scores(self) -> dict[str, float]:
        """Each broker's latency score for p2c: its peak EWMA here, else the table's latency.

        Each replica scores from the reports it handled itself: with reports spread
        over replicas that is a sample of every producer's, and costs no store traffic.
        """
        now = self.now_ms()
        scores = {b: float(i.current_latency_ms) for b, i in self.faults.items()}
        scores.update({b: idle_score(v, at, now) for b, (v, at) in self._ewma.items()})
        return scores

    # -- probation probes --------------------------------------------------
    def free_probes(self, now_ms: int) -> set[str]:
        """Brokers on probation this replica may give a probe to now (policy.probe_free).

        Each replica hands out its own probe: a global one would need a store round
        trip on /select (docs/policy.md).
        """
        return {
            b
            for b, item in self.faults.items()
            if probe_free(item, now_ms, self.config, self._probes.get(b))
        }

    def probe_sent(self, broker: str, now_ms: int) -> None:
        item = self.faults.get(broker)
        if item is not None:
            self._probes[broker] = (item.available_at, now_ms)

    # -- changes -----------------------------------------------------------
    def apply_fault(self, broker: str, item: FaultItem | None, version: int) -> None:
        # The writer applies its own change, then receives its push: apply once.
        if version <= self._fault_v.get(broker, 0):
            return
        self._fault_v[broker] = version
        if item is None:
            self.faults.pop(broker, None)
        else:
            self.faults[broker] = item
        self._notify("fault", broker, item, version)

    def set_local_fault(self, item: FaultItem) -> None:
        """A window this replica decided while the store was unreachable.

        Its version is left alone, so the next snapshot (taken after the
        journal is replayed) replaces it with the store's value.
        """
        self.faults[item.broker_name] = item
        self._notify("fault", item.broker_name, item, 0)

    def apply_route(self, topic: str, route: Route | None, version: int) -> None:
        if version <= self._route_v.get(topic, 0):
            return
        self._route_v[topic] = version
        if route is None:
            self.routes.pop(topic, None)
        else:
            self.routes[topic] = route
        self._notify("route", topic, route, version)

    def apply_config(self, config: Config, version: int) -> None:
        if version <= self.config_version:
            return
        self.config = config
        self.config_version = version
        self._notify("config", "", config, version)

    def replace(self, snap: Snapshot, reset: bool = False) -> None:
        """Install a full snapshot, keeping entries already applied at a newer version.

        A snapshot older than what this view has applied means the store lost
        its data (a restart without persistence, a flush): then the snapshot
        wins whole, because the version numbers started again. ``reset`` says so
        explicitly (after a re-seed the new numbers may already be higher).
        """
        if reset or snap.version < self.version:
            self._route_v, self._fault_v, self.config_version, self.version = {}, {}, -1, 0
        routes = dict(snap.routes)
        route_v = {t: snap.version for t in routes}
        for topic, v in self._route_v.items():
            if v > snap.version:
                route_v[topic] = v
                if topic in self.routes:
                    routes[topic] = self.routes[topic]
                else:
                    routes.pop(topic, None)
        faults = dict(snap.faults)
        fault_v = {b: snap.version for b in faults}
        for broker, v in self._fault_v.items():
            if v > snap.version:
                fault_v[broker] = v
                if broker in self.faults:
                    faults[broker] = self.faults[broker]
                else:
                    faults.pop(broker, None)
        self.routes, self._route_v = routes, route_v
        self.faults, self._fault_v = faults, fault_v
        if snap.config_version >= self.config_version:
            self.config, self.config_version = snap.config, snap.config_version
        self.version = max(self.version, snap.version)
        self._notify("snapshot", "", None, self.version)
