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
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
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

#: One of this client's reports for its own table: (broker, latency_ms, isolation, age_ms).
OwnReport = tuple[str, float, bool, int]
#: The reports Detour has not accepted yet, read under the table's lock (given its config),
#: so that a report queued before an event is re-applied with it, never undone by it.
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

    def fault(self, broker_name: str) -> FaultItem | None:
        return self.view.faults.get(broker_name)

    # -- own reports -----------------------------------------------------------
    def apply_report(
        self, broker_name: str, latency_ms: float, isolation: bool, age_ms: int = 0
    ) -> FaultItem | None:
        """Apply one report as Detour would, at ``now - age_ms``; returns the broker's item.

        With avoidance off the report changes nothing (RocketMQ's updateFaultItem).
        """
        with self._lock:
            self._apply_own([(broker_name, latency_ms, isolation, age_ms)])
            return self.view.faults.get(broker_name)

    def _apply_own(self, reports: Sequence[OwnReport]) -> None:
        """Under the lock: this client's ``(broker, latency_ms, isolation, age_ms)`` reports,
        in order, as one ``apply_reports`` call (one rule, one pass over the table)."""
        if not reports:
            return
        producer = self.producer or ""
        batch = [ReportIn(b, math.floor(ms), iso, age, producer) for b, ms, iso, age in reports]
        view = self.view
        now = view.now_ms()
        applied = apply_reports(view.faults, batch, now, Rules(view.config, MAX_ITEMS))
        for broker in applied.evicted:
            self._apply_fault(broker, None)
        for report, effect in zip(batch, applied.effects, strict=False):
            if effect.written and effect.item is not None:
                self._apply_fault(report.broker_name, effect.item)
                view.observe_latency(report.broker_name, report.latency_ms, now)

    def hint_avoided(self, brokers: Iterable[str], until_ms: int) -> None:
        """Detour avoids ``brokers`` now (a select's ``avoidedBrokers``): a local select
        avoids them too until at least ``until_ms``. A window already longer stays; nothing
        else of a broker's item changes."""
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
                view.apply_fault(broker, item, self._next_version())

    # -- what the service says -------------------------------------------------
    def _apply_fault(self, broker_name: str, item: FaultItem | None) -> None:
        """Under the lock: apply one item (the view ends the select epoch when a select
        may read the change)."""
        self.view.apply_fault(broker_name, item, self._next_version())

    def set_route(self, topic: str, route: Route | None) -> None:
        with self._lock:
            self.view.apply_route(topic, route, self._next_version())

    def set_config(self, config: Config) -> None:
        with self._lock:
            self.view.apply_config(config, self._next_version())

    def set_fault(self, broker_name: str, item: FaultItem | None, own: OwnReports = _none) -> None:
        """Detour's item for the broker, then the ``own`` reports it has not accepted yet,
        under one lock: a select never sees the item without them."""
        with self._lock:
            self._apply_fault(broker_name, item)
            self._apply_own(own(self.view.config))

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
                    faults=dict(faults),
                )
            )
            self._apply_own(own(config))
