"""The client's own copy of the table, decided with the service's algorithm.

A ``detour.view.TableView`` decided by ``detour.selector.choose_on``, the code
``POST /select`` runs (``detour.decide``), not a copy: a local decision is the one
Detour would make with the same table, config and random draws, every policy field
included. Reports are applied with ``detour.apply.apply_reports``, the service's own
rule (the quorums, backoff, probation, the table cap). The remote client fills the table with
its own reports and the fetched routes and config and uses it only when Detour is
unavailable (RocketMQ's producer-local table, on the process wall clock); the cached
client keeps it current from the event stream and decides every select here, on its
estimate of the service's clock.

Thread-safe: producer threads select and report while a background thread
applies stream events. Versions in the view are local sequence numbers: the
stream is ordered, so the newest thing applied always wins.

Why writers work outside the lock: a select waits for the lock, and a writer that
held it while it applied reports through the rule (a stream event re-applies this
client's waiting ones) held every select of the process behind it for as long as
the interpreter let that thread run, milliseconds on a busy machine
(docs/BENCHMARKS.md, "Cached mode re-measured"). So a report and a fault event
work out their items first, on what the table holds then, and take the lock only
to check what has changed since (``_Stamps``) and to write the items. A fault event
then also applies the reports that landed meanwhile (a few, kept for this); if
anything else changed, the work is done again under the lock, as before.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from detour.apply import ReportIn, Rules, apply_reports
from detour.client.values import SelectedQueue
from detour.decide import Ask
from detour.model import Config, FaultItem, Route
from detour.policy import Choice
from detour.selector import choose_kept, choose_on
from detour.view import Snapshot, TableView

#: Fault items the SDK's copy holds at most, as a namespace's table in Detour: its own
#: reports beyond it drop ended windows first, then change nothing.
MAX_ITEMS = 10_000

#: Writes of brokers' items are counted in this many stripes (a broker's is its hash's).
STRIPES = 64
#: Reports each stripe keeps, for an event worked out outside the lock to apply after its
#: own those that landed meanwhile; if more landed, it is worked out again under the lock.
LOGGED = 16

#: One of this client's reports for its own table: (broker, latency_ms, isolation, age_ms).
OwnReport = tuple[str, float, bool, int]
#: The reports Detour has not accepted yet (given the table's config), read with an event
#: so that a report queued before it is re-applied with it, never undone by it.
OwnReports = Callable[[Config], Sequence[OwnReport]]


def _none(config: Config) -> Sequence[OwnReport]:
    return ()


def _answer(route: Route, choice: Choice) -> SelectedQueue:
    sel, av = choice.selection, choice.avoidance
    q = sel.queue
    return SelectedQueue(
        route.topic,
        q.broker_name,
        q.queue_id,
        route.addresses.get(q.broker_name),
        sel.decision,
        sel.avoided_brokers,
        True,
        panic=av.panic,
        dry_run=av.dry_run,
        unenforced_brokers=av.unenforced,
        ordered=choice.ordered,
        probe=choice.probe is not None,
    )


#: What reports of one broker write, worked out outside the lock: its item after the last
#: of them that wrote one (None: none did), and the latencies of those, in order.
Plan = tuple[FaultItem | None, list[int]]
#: ``_Stamps.of``: (epoch, the stripe's other writes, the stripe's reports).
Stamp = tuple[int, int, int]
#: ``LocalTable.route_stamp``: (snapshots installed, the topic's route version).
RouteStamp = tuple[int, int]


class _Stamps:
    """What a write worked out outside the lock read, counted, so that it can tell under
    the lock what has changed since: the config and the whole table (``epoch``: a config,
    a snapshot), and per stripe of broker names the writes of an item that are not this
    client's reports (``writes``: Detour's events, hints) and the reports applied
    (``reported``, with the newest ``LOGGED`` of them kept); and the snapshots installed
    (``snapshots``: with the topic's route version, ``LocalTable.route_stamp``).

    Bounded whatever the names: brokers sharing a stripe only cost a plan its shortcut.
    A writer counts after it wrote (and a plan reads its stamp before anything else): a
    plan that read an item while a write was half done then sees the count move.
    """

    __slots__ = ("epoch", "writes", "reported", "logs", "snapshots")

    def __init__(self) -> None:
        self.epoch = 0
        self.snapshots = 0
        self.writes = [0] * STRIPES
        self.reported = [0] * STRIPES
        self.logs: list[deque[tuple[OwnReport, int]]] = [
            deque(maxlen=LOGGED) for _ in range(STRIPES)
        ]

    @staticmethod
    def _stripe(broker: str) -> int:
        return hash(broker) % STRIPES

    def of(self, broker: str) -> Stamp:
        h = self._stripe(broker)
        return self.epoch, self.writes[h], self.reported[h]

    def wrote(self, broker: str) -> None:
        self.writes[self._stripe(broker)] += 1

    def report(self, report: OwnReport, now: int) -> None:
        h = self._stripe(report[0])
        self.reported[h] += 1
        self.logs[h].append((report, now))

    def reports_since(self, broker: str, stamp: Stamp) -> list[tuple[OwnReport, int]] | None:
        """The reports of ``broker`` applied since ``stamp`` was read, oldest first, each
        with the time it was applied at; None when anything else moved, or more reports
        than are kept."""
        h = self._stripe(broker)
        if (self.epoch, self.writes[h]) != stamp[:2]:
            return None
        landed = self.reported[h] - stamp[2]
        if landed > LOGGED:
            return None
        log = self.logs[h]
        return [e for e in itertools.islice(log, len(log) - landed, None) if e[0][0] == broker]


class LocalTable:
    def __init__(self, clock: Callable[[], int], producer: str | None = None) -> None:
        """``clock``: epoch ms on the clock the table's windows are written in.
        ``producer``: who this client is, for the windows of its own failures short of
        the isolation quorum (Detour counts a producer by this id, by its token's name
        when tokens are on)."""
        self.view = TableView(clock)
        self.producer = producer
        self._lock = threading.Lock()
        self._version = 0
        self._stamps = _Stamps()

    def _next_version(self) -> int:
        self._version += 1
        return self._version

    def now_ms(self) -> int:
        return self.view.now_ms()

    # -- reads -----------------------------------------------------------------
    def select(
        self,
        topic: str,
        last_broker: str | None,
        sharding_key: str | None = None,
        rng: random.Random | None = None,
    ) -> SelectedQueue | None:
        """Choose a queue for ``topic`` in-process, or None when its route is unknown.

        Decided as ``POST /select`` decides (``detour.selector.choose_on``) and advances
        the topic's round-robin counter as it does; ``rng`` makes the draws the config
        needs (the selector's own generator by default).

        A first attempt (no ``last_broker``, no key, the selector's generator) is
        ``choose_kept``'s, as on the service: answered from the answers kept while they
        provably repeat (``detour.memo``).
        """
        with self._lock:
            view = self.view
            route = view.routes.get(topic)
            if route is None:
                return None
            now = view.now_ms()
            if last_broker is None and sharding_key is None and rng is None and route.queues:
                return choose_kept(view, route, self.producer, now, _answer)
            choice = choose_on(view, route, Ask(last_broker, self.producer, sharding_key), rng, now)
        return _answer(route, choice)

    def has_route(self, topic: str) -> bool:
        return topic in self.view.routes

    def in_route(self, topic: str, broker_name: str, queue_id: int) -> bool | None:
        """Whether the known route of ``topic`` has that queue; None when no route is known."""
        route = self.view.routes.get(topic)
        if route is None:
            return None
        return any(q.queue_id == queue_id for q in route.by_broker.get(broker_name, ()))

    def check_answer(self, selected: SelectedQueue) -> str | None:
        """What is wrong with a select answer given the known route of its topic, or None.

        Wrong: no route known; a queue the route does not have; an ``address`` other than
        the one the route gives the broker (None when it gives none); an avoided broker
        that is the chosen one (Detour never names it). Avoided or unenforced names outside
        the route are not wrong (a route may have changed meanwhile): ``of_route`` drops
        them before they reach the table.
        """
        route = self.view.routes.get(selected.topic)
        broker, queue_id = selected.broker_name, selected.queue_id
        if route is None:
            return f"no route of topic {selected.topic!r} is known to check the answer against"
        if not any(q.queue_id == queue_id for q in route.by_broker.get(broker, ())):
            return f"queue {broker}/{queue_id} is not in the route of topic {selected.topic!r}"
        if selected.address != route.addresses.get(broker):
            return (
                f"address {str(selected.address)[:100]!r} is not the route's for {broker} "
                f"({route.addresses.get(broker)!r})"
            )
        if broker in selected.avoided_brokers:
            return f"the chosen broker {broker} is also named as avoided"
        return None

    def of_route(self, topic: str, brokers: Iterable[str]) -> list[str]:
        """Those of ``brokers`` the known route of ``topic`` has (none when no route is
        known), each once: what an answer's names may add to this table."""
        route = self.view.routes.get(topic)
        if route is None:
            return []
        return [b for b in dict.fromkeys(brokers) if b in route.by_broker]

    def fault(self, broker_name: str) -> FaultItem | None:
        return self.view.faults.get(broker_name)

    # -- own reports -----------------------------------------------------------
    def apply_report(
        self, broker_name: str, latency_ms: float, isolation: bool, age_ms: int = 0
    ) -> FaultItem | None:
        """Apply one report as Detour would, at ``now - age_ms``; returns the broker's item.

        With avoidance off the report changes nothing (RocketMQ's updateFaultItem).
        Worked out before the lock is taken, on the broker's item then (``_plan``).
        """
        report = [(broker_name, latency_ms, isolation, age_ms)]
        view = self.view
        stamp = self._stamps.of(broker_name)
        base, config = view.faults.get(broker_name), view.config
        now = view.now_ms()
        plan = self._plan(broker_name, base, report, config, now)
        with self._lock:
            if plan is not None and self._stamps.of(broker_name) == stamp:
                self._install(broker_name, plan, now)
                self._stamps.report(report[0], now)
            else:
                self._apply_own(report)
            return view.faults.get(broker_name)

    def _plan(
        self,
        broker: str,
        base: FaultItem | None,
        reports: Sequence[OwnReport],
        config: Config,
        now: int,
    ) -> Plan | None:
        """Outside the lock: what ``reports`` (all of ``broker``) write on ``base``, its item,
        as ``_apply_own`` would; None when that needs the whole table (near the cap, where
        writing may drop other items) or the reports name another broker.

        Only the last item is written: a select never sees the ones before it (they would
        be written under one lock), so writing each was work done with every select
        waiting."""
        if len(self.view.faults) + 1 >= MAX_ITEMS or any(r[0] != broker for r in reports):
            return None
        batch = self._batch(reports)
        table = {} if base is None else {broker: base}
        applied = apply_reports(table, batch, now, Rules(config, MAX_ITEMS))
        last: FaultItem | None = None
        latencies = []
        for report, effect in zip(batch, applied.effects, strict=False):
            if effect.written and effect.item is not None:
                last = effect.item
                latencies.append(report.latency_ms)
        return last, latencies

    def _install(self, broker: str, plan: Plan, now: int, again: bool = False) -> None:
        """Under the lock: a plan's item and latencies (``again``: as ``_apply_own``'s)."""
        item, latencies = plan
        if item is not None:
            self._apply_fault(broker, item)
        for latency_ms in () if again else latencies:
            self.view.observe_latency(broker, latency_ms, now)

    def _batch(self, reports: Sequence[OwnReport]) -> list[ReportIn]:
        producer = self.producer or ""
        return [ReportIn(b, math.floor(ms), iso, age, producer) for b, ms, iso, age in reports]

    def _apply_own(
        self, reports: Sequence[OwnReport], now: int | None = None, again: bool = False
    ) -> None:
        """Under the lock: this client's ``(broker, latency_ms, isolation, age_ms)`` reports,
        in order, as one ``apply_reports`` call (one rule, one pass over the table), at
        ``now`` (the table's clock by default). ``again``: reports re-applied after an
        event, not new ones: ``_Stamps`` does not count them, and their latencies, folded
        into the broker's score when they were first applied, are not folded again (each
        event would otherwise renew an old answer's weight)."""
        if not reports:
            return
        batch = self._batch(reports)
        view = self.view
        now = view.now_ms() if now is None else now
        applied = apply_reports(view.faults, batch, now, Rules(view.config, MAX_ITEMS))
        for broker in applied.evicted:
            self._apply_fault(broker, None)
            self._stamps.wrote(broker)
        for report, effect in zip(batch, applied.effects, strict=False):
            if effect.written and effect.item is not None:
                self._apply_fault(report.broker_name, effect.item)
                if not again:
                    view.observe_latency(report.broker_name, report.latency_ms, now)
        if not again:
            for own in reports:
                self._stamps.report(own, now)

    def hint_avoided(self, brokers: Iterable[str], until_ms: int) -> None:
        """Detour avoids ``brokers`` now (a select's ``avoidedBrokers``, those of its route:
        ``of_route``): a local select avoids them too until at least ``until_ms``. A window
        already longer stays; nothing else of a broker's item changes. Within the cap
        (``_apply_fault``)."""
        with self._lock:
            view = self.view
            for broker in brokers:
                old = view.faults.get(broker)
                if old is None:
                    item = FaultItem(broker, 0, until_ms)
                elif old.available_at < until_ms:
                    item = dataclasses.replace(old, available_at=until_ms)
                else:
                    continue
                self._apply_fault(broker, item)
                self._stamps.wrote(broker)

    # -- what the service says -------------------------------------------------
    def _apply_fault(self, broker_name: str, item: FaultItem | None) -> None:
        """Under the lock: apply one item (the view ends the select epoch when a select
        may read the change).

        The one place items enter the table, so the cap is held here: an item for a broker
        the table does not hold yet is not added at ``MAX_ITEMS`` (the report rule evicts
        before it writes; hints and a stream beyond Detour's own cap are what this stops)."""
        faults = self.view.faults
        if item is not None and broker_name not in faults and len(faults) >= MAX_ITEMS:
            return
        self.view.apply_fault(broker_name, item, self._next_version())

    def set_route(self, topic: str, route: Route | None) -> None:
        """The topic's route as Detour pushed it (the stream is ordered: the newest wins)."""
        with self._lock:
            self._set_route(topic, route)

    def _set_route(self, topic: str, route: Route | None) -> None:
        self.view.apply_route(topic, route, self._next_version())

    def route_stamp(self, topic: str) -> RouteStamp:
        """Read as a fetch of ``topic``'s route is asked for, for ``set_fetched_route``:
        every write of the topic's route moves its version (versions here are this table's
        sequence numbers), and a snapshot moves ``snapshots``."""
        return self._stamps.snapshots, self.view.route_version(topic)

    def set_fetched_route(self, topic: str, route: Route | None, asked: RouteStamp) -> bool:
        """The route a fetch asked for at ``asked`` (``route_stamp``) answered (None: Detour
        has none), unless the topic's route was written while the fetch was on its way;
        whether it was installed.

        A fetch's answer carries no version, and what was written meanwhile may be newer
        than what Detour read for it: the stream's push (ordered, so newer than anything
        before it) or another fetch of the topic that ended first, asked for later. Writing
        the late answer over it kept the older route until the next refresh, 30 s on (in
        cached mode, until the topic's next change). Only this topic's writes and snapshots
        count: a first fetch of a topic is never refused for another's."""
        with self._lock:
            if self.route_stamp(topic) != asked:
                return False
            self._set_route(topic, route)
            return True

    def set_config(self, config: Config) -> None:
        """The config as Detour pushed it (the stream is ordered: the newest wins)."""
        with self._lock:
            self._set_config(config)

    def _set_config(self, config: Config) -> None:
        self.view.apply_config(config, self._next_version())
        self._stamps.epoch += 1

    def config_stamp(self) -> int:
        """Read as a fetch of the config is asked for, for ``set_fetched_config``."""
        return self._stamps.epoch

    def set_fetched_config(self, config: Config, asked: int) -> bool:
        """The config a fetch asked for at ``asked`` (``config_stamp``) answered, unless a
        config or a snapshot was written while it was on its way; whether it was
        installed. As ``set_fetched_route``: the answer carries no version."""
        with self._lock:
            if self._stamps.epoch != asked:
                return False
            self._set_config(config)
            return True

    def set_fault(self, broker_name: str, item: FaultItem | None, own: OwnReports = _none) -> None:
        """Detour's item for the broker, then the ``own`` reports it has not accepted yet
        (of this broker), installed together: a select never sees the item without them.

        ``own`` is read, and the reports applied on ``item``, before the lock is taken.
        A report queued before ``own`` is read is among them. One queued after it is
        applied after it is queued (``ClientCore.apply``): after this event's write, on
        top of it, or before, and then it is applied again after the write here, as its
        stripe kept it (``_Stamps.reports_since``). As before the work moved out of the
        lock, a report queued just before ``own`` is read and applied just after may be
        applied twice: extend-only, so only ``repeatMultiplier``'s count can tell.
        If anything else moved, the event is worked out again under the lock.
        """
        view = self.view
        stamp = self._stamps.of(broker_name)
        config = view.config
        now = view.now_ms()
        plan = self._plan(broker_name, item, own(config), config, now)
        with self._lock:
            landed = None if plan is None else self._stamps.reports_since(broker_name, stamp)
            if plan is None or landed is None:
                self._apply_fault(broker_name, item)
                self._apply_own(own(view.config), again=True)
            else:
                if item is None or plan[0] is None:
                    self._apply_fault(broker_name, item)  # a delete also drops its scores
                self._install(broker_name, plan, now, again=True)
                for report, at in landed:
                    self._apply_own([report], at, again=True)
            self._stamps.wrote(broker_name)

    def replace(
        self,
        config: Config,
        routes: Iterable[Route],
        faults: Mapping[str, FaultItem],
        own: OwnReports = _none,
    ) -> None:
        """Install a whole table (a stream snapshot): newer than anything applied, so it wins;
        then ``own`` reports Detour has not accepted yet, under the same lock."""
        with self._lock:
            v = self._next_version()
            self.view.replace(
                Snapshot(
                    version=v,
                    config=config,
                    config_version=v,
                    routes={r.topic: r for r in routes},
                    # the cap, as for every other way in (``_apply_fault``)
                    faults=dict(itertools.islice(faults.items(), MAX_ITEMS)),
                )
            )
            self._apply_own(own(config), again=True)
            self._stamps.epoch += 1
            self._stamps.snapshots += 1
