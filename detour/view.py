"""A replica's copy of the shared table: config, routes and fault windows, read by /select.

/select never waits on a store: it reads this view. The memory store writes it
directly; the Redis store keeps it current from pushed changes and resyncs.
Every entry carries the store version it was written at, so a late or
duplicated change can never overwrite a newer one (deletes leave tombstones).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from detour.memo import Memos
from detour.model import Config, FaultItem, Route
from detour.policy.steady import select_reads
from detour.selector_state import SelectorState

#: Changes a follower of the table applies in one turn of its event loop at most: a
#: replica's pushes (service/store/follower.py) and the async SDK's stream events
#: (detour/client/tasks.py). A batch's 1,000 window changes arrive together, and a buffered
#: message is read without giving the loop up: applied in one turn, they held everything
#: else on that loop (the replica's requests, the producer's own sends) behind them.
CHANGES_PER_TURN = 32


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The whole table as of one store version."""

    version: int
    config: Config
    config_version: int
    routes: Mapping[str, Route]
    faults: Mapping[str, FaultItem]
    #: the stamps of the config's and each route's write (detour.merge; 0: none)
    config_stamp: int = 0
    route_stamps: Mapping[str, int] = field(default_factory=dict)


class Graves:
    """Deletes this replica applied, with their stamps, kept for merges (detour.merge): a
    table restored from a copy older than the delete gets the delete back, not the entry.

    Bounded: each is kept ``ttl_ms`` (longer than any outage Detour rides out: the journal
    keeps reports a day) and at most ``cap`` of them, the oldest dropped first.
    """

    TTL_MS = 7 * 86_400_000
    CAP = 65_536

    def __init__(self, ttl_ms: int = TTL_MS, cap: int = CAP) -> None:
        self._ttl_ms, self._cap = ttl_ms, cap
        #: name -> (the delete's stamp, when it was kept (ms)), oldest first
        self._graves: dict[str, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._graves)

    def add(self, name: str, stamp: int, now_ms: int) -> None:
        if stamp <= 0:
            return
        self._graves.pop(name, None)
        self._graves[name] = (stamp, now_ms)
        self.expire(now_ms)

    def expire(self, now_ms: int) -> None:
        graves = self._graves
        while graves:
            oldest = next(iter(graves))
            if len(graves) <= self._cap and graves[oldest][1] > now_ms - self._ttl_ms:
                return
            del graves[oldest]

    def items(self, now_ms: int) -> list[tuple[str, int]]:
        """(name, the delete's stamp) of every grave still kept."""
        self.expire(now_ms)
        return [(name, stamp) for name, (stamp, _) in self._graves.items()]


ChangeKind = Literal["fault", "route", "config", "snapshot", "stop"]
#: (kind, key, value, version): ("fault", broker, FaultItem | None), ("route", topic,
#: Route | None), ("config", "", Config), ("snapshot", "", None) after a resync replaced
#: everything. version is the store version of the change (0 for a window this replica set
#: on its own while the store was unreachable).
Listener = Callable[[ChangeKind, str, object, int], None]


class _Tombstones:
    """Deleted names whose version is still kept, oldest first, swept as the view catches up."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._dead: dict[str, int] = {}
        #: Sweep when this many are held (doubles with what a sweep could not drop).
        self._sweep_at = 1024

    def __len__(self) -> int:
        return len(self._dead)

    def pop(self, name: str, default: int | None = None) -> int | None:
        return self._dead.pop(name, default)

    def add(self, name: str, version: int, applied: int, versions: dict[str, int]) -> None:
        """Keep ``name``'s tombstone; ``applied``: every change up to it was applied."""
        dead = self._dead
        dead.pop(name, None)
        dead[name] = version
        if len(dead) < self._sweep_at:
            return
        for old in [n for n, v in dead.items() if v <= applied]:
            del dead[old]
            versions.pop(old, None)
        if len(dead) > self.cap:
            # Down to half (the oldest first), so the next sweep is cap / 2 deletes away.
            while len(dead) > self.cap // 2:
                old = next(iter(dead))
                del dead[old]
                versions.pop(old, None)
        self._sweep_at = max(1024, min(2 * len(dead), self.cap + 1))

    def retain(self, versions: dict[str, int]) -> None:
        """After a resync: keep only the tombstones ``versions`` still holds."""
        self._dead = {n: v for n, v in self._dead.items() if versions.get(n) == v}


class TableView:
    """The versioned table copy, and (``selector``) what this replica's selects keep.

    Every per-name map is bounded and dropped with its item: the table's own by the
    store's caps (``max_brokers``, the routes an admin sets); a deleted entry's
    tombstone (the version that must not be overwritten by a late change) only until
    every change up to that version has been applied in sequence (``version``), and
    at most ``MAX_TOMBSTONES`` of them; the selector's maps as ``SelectorState`` says.
    """

    #: Tombstones kept at most (past it the older half goes): only a change older than a
    #: dropped tombstone, arriving after more than this many deletes, could then undo
    #: one, and the next resync repairs it.
    MAX_TOMBSTONES = 65_536

    def __init__(
        self, clock: Callable[[], int], namespace: str = "default", config: Config | None = None
    ) -> None:
        #: Epoch ms on the store's clock (Redis TIME for Redis, the process clock for memory).
        self.now_ms = clock
        #: Whose table this is (a label on the metrics it feeds).
        self.namespace = namespace
        #: The table's config; before any was written, the one a new table starts with
        #: (detour/profiles.py), at stamp 0.
        self.initial_config = Config() if config is None else config
        self.config = self.initial_config
        #: Store version at which ``config`` was written; reports carry it so a
        #: replica never applies tiers it has not seen yet.
        self.config_version = 0
        #: The stamp of the config's write (0: the default, never written): what reports
        #: name to the store, and what a merge compares (detour.merge).
        self.config_stamp = 0
        self.routes: dict[str, Route] = {}
        #: The stamp of each route's write (detour.merge).
        self.route_stamps: dict[str, int] = {}
        #: Deletes of routes and of fault items, kept for merges.
        self.route_graves = Graves()
        self.fault_graves = Graves()
        #: Brokers whose item this replica decided alone while the store was unreachable
        #: (``set_local_fault``), until the store's copy replaces it.
        self.local: set[str] = set()
        self.faults: dict[str, FaultItem] = {}
        #: Highest version applied in sequence (gap detection for pushes).
        self.version = 0
        self._route_v: dict[str, int] = {}
        self._fault_v: dict[str, int] = {}
        #: Deleted names whose version is still kept, oldest first (insertion order).
        self._route_dead = _Tombstones(self.MAX_TOMBSTONES)
        self._fault_dead = _Tombstones(self.MAX_TOMBSTONES)
        #: Round-robin counters, peak-EWMA scores, probes: this replica's own.
        self.selector = SelectorState()
        #: The topic's round-robin position on this replica (SelectorState.counter), and
        #: its update: bound here rather than delegated, as every select calls both.
        self.counter = self.selector.counter
        self.set_counter = self.selector.set_counter
        #: Moves on every change a select may read (``select_reads``: a window, votes, the
        #: config, a snapshot): the answers kept in ``memos`` hold only within one epoch (and
        #: for one route object: a route write replaces the object, and moves no epoch).
        self.select_epoch = 0
        #: The kept answers of unkeyed selects (detour.memo, detour.selector.choose_kept).
        self.memos: Memos[Any] = Memos()
        self._listeners: list[Listener] = []

    def bound_names(self, max_topics: int, max_brokers: int) -> None:
        """Set the selector's caps: topics whose counter is kept, brokers whose score is."""
        self.selector.max_topics = max_topics
        self.selector.max_brokers = max_brokers

    def sizes(self) -> dict[str, int]:
        """How many names each map holds (tests and the bounds' documentation)."""
        counters, ewma, probes = self.selector.sizes()
        return {
            "routes": len(self.routes),
            "faults": len(self.faults),
            "route_versions": len(self._route_v),
            "fault_versions": len(self._fault_v),
            "counters": counters,
            "ewma": ewma,
            "probes": probes,
        }

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

    def window_end(self, broker: str) -> int:
        """The broker's window end as this copy holds it (now when it has no item)."""
        item = self.faults.get(broker)
        return item.available_at if item is not None else self.now_ms()

    # -- the selector's own state (kept here for the callers' sake) ----------
    def observe_latency(self, broker: str, latency_ms: int, now_ms: int) -> None:
        """Fold one reported latency into the broker's peak EWMA (this replica's reports)."""
        self.selector.observe_latency(broker, latency_ms, now_ms)

    @property
    def latency_scores(self) -> dict[str, float]:
        """Each broker's latency score for p2c: its peak EWMA here, else the table's latency.

        Each replica scores from the reports it handled itself: with reports spread
        over replicas that is a sample of every producer's, and costs no store traffic.
        """
        return self.selector.latency_scores(self.faults, self.now_ms())

    def free_probes(self, now_ms: int) -> set[str]:
        """Brokers on probation this replica may give a probe to now (policy.probe_free).

        Each replica hands out its own probe: a global one would need a store round
        trip on /select (docs/policy.md).
        """
        return self.selector.free_probes(self.faults, self.config, now_ms)

    def probe_sent(self, broker: str, now_ms: int) -> None:
        item = self.faults.get(broker)
        if item is not None:
            self.selector.probe_sent(item, now_ms)

    # -- tombstones --------------------------------------------------------
    def _bury(self, dead: _Tombstones, versions: dict[str, int], name: str, version: int) -> None:
        """Keep a deleted name's version only while an older change for it may still come:
        once every change up to it was applied in sequence (``self.version``), none can."""
        if version <= self.version:
            versions.pop(name, None)
            dead.pop(name, None)
            return
        dead.add(name, version, self.version, versions)

    # -- changes -----------------------------------------------------------
    def apply_fault(
        self, broker: str, item: FaultItem | None, version: int, stamp: int = 0
    ) -> None:
        """``stamp``: a delete's stamp (kept as a grave for merges)."""
        # The writer applies its own change, then receives its push: apply once.
        if version <= self._fault_v.get(broker, 0):
            return
        self._fault_v[broker] = version
        self._select_may_change(broker, item)
        if item is None:
            self.faults.pop(broker, None)
            self.selector.forget_broker(broker)
            self.fault_graves.add(broker, stamp, self.now_ms())
            self._notify("fault", broker, item, version)
            self._bury(self._fault_dead, self._fault_v, broker, version)
        else:
            self._fault_dead.pop(broker)
            self.faults[broker] = item
            self.local.discard(broker)
            self._notify("fault", broker, item, version)

    def set_local_fault(self, item: FaultItem) -> None:
        """A window this replica decided while the store was unreachable.

        Its version is left alone, so the next snapshot (taken after the
        journal is replayed) replaces it with the store's value. It is ``local`` until
        then: a merge leaves it to the journal, which holds the reports that made it.
        """
        self._select_may_change(item.broker_name, item)
        self.faults[item.broker_name] = item
        self.local.add(item.broker_name)
        self._notify("fault", item.broker_name, item, 0)

    def drop_local_fault(self, broker: str) -> None:
        """An item this replica dropped from its own copy to make room (its window had
        ended) while the store was unreachable; the next snapshot settles it."""
        self.local.discard(broker)
        self._select_may_change(broker, None)
        if self.faults.pop(broker, None) is not None:
            self._notify("fault", broker, None, 0)

    def learn_fault(self, item: FaultItem) -> None:
        """An item the store created without a push (a broker's first report, no window),
        learnt from a reply: unversioned, so the next snapshot or push replaces it."""
        self._select_may_change(item.broker_name, item)
        self.faults[item.broker_name] = item

    def _select_may_change(self, broker: str, item: FaultItem | None) -> None:
        """Before ``broker``'s item becomes ``item``: end the select epoch when a select
        may read the difference (a healthy answer's new latency leaves the kept answers)."""
        config = self.config
        if select_reads(self.faults.get(broker), config) != select_reads(item, config):
            self.select_epoch += 1

    def route_version(self, topic: str) -> int:
        """The version of the topic's last route write applied (0: none known): its route's,
        or its delete's while the delete's tombstone is kept."""
        return self._route_v.get(topic, 0)

    def apply_route(self, topic: str, route: Route | None, version: int, stamp: int = 0) -> None:
        """``stamp``: the write's (a delete's is kept as a grave for merges)."""
        if version <= self._route_v.get(topic, 0):
            return
        self._route_v[topic] = version
        # No select epoch: a topic's kept answers are kept for its route object
        # (``choose_kept``'s rule), which this write replaces; another topic's route is nothing
        # its selects read, and ending every topic's answers on each route write made a
        # busy table of routes decide in full again and again.
        if route is None:
            self.routes.pop(topic, None)
            self.route_stamps.pop(topic, None)
            self.selector.forget_topic(topic)
            self.route_graves.add(topic, stamp, self.now_ms())
            self._notify("route", topic, route, version)
            self._bury(self._route_dead, self._route_v, topic, version)
        else:
            self._route_dead.pop(topic)
            self.routes[topic] = route
            self.route_stamps[topic] = stamp
            self._notify("route", topic, route, version)

    def apply_config(self, config: Config, version: int, stamp: int = 0) -> None:
        if version <= self.config_version:
            return
        self.config = config
        self.config_version = version
        self.config_stamp = stamp
        self.select_epoch += 1
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
        for topic in self.routes.keys() - routes.keys():
            self.selector.forget_topic(topic)
        self.selector.forget_brokers(self.faults.keys() - faults.keys())
        stamps = {t: snap.route_stamps.get(t, 0) for t in routes}
        for topic in routes:
            if route_v[topic] > snap.version:
                stamps[topic] = self.route_stamps.get(topic, 0)
        old_faults = self.faults
        self.routes, self._route_v, self.route_stamps = routes, route_v, stamps
        self.faults, self._fault_v = faults, fault_v
        # a local item stays local only where the view's own copy was kept
        self.local = {b for b in self.local if b in faults and faults[b] is old_faults.get(b)}
        self._route_dead.retain(route_v)
        self._fault_dead.retain(fault_v)
        if snap.config_version >= self.config_version:
            self.config, self.config_version = snap.config, snap.config_version
            self.config_stamp = snap.config_stamp
        self.version = max(self.version, snap.version)
        self.select_epoch += 1
        self._notify("snapshot", "", None, self.version)
