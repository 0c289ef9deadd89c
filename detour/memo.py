"""The answers of a topic's unkeyed selects, kept while they provably repeat.

Most selects, in Detour and in a cached client alike, decide on a table that has not
changed in anything a select reads since the last lap of the route. ``steady`` says when
that holds (``detour.policy.steady``): then the answer of a select whose walk starts at
queue ``i`` is the answer the last one starting there got, and the select is a lookup
and a counter step instead of a decision. The answer kept is the one ``choose_on`` gave,
never one made up here, so both paths answer alike by construction; a test drives random
tables and configs through both (tests/test_memo.py). ``detour.selector.choose_kept``
is the one select that uses them.

What an answer is stays the caller's: the service keeps the ``Choice`` with its answer's
JSON text, rendered once (``service.api.select.rendered``: only ``degraded`` is written
per request), the SDK the ``SelectedQueue`` it hands out (building one per select would
cost it as much as the lookup).

Not thread-safe on its own: the SDK calls it under its table's lock, the service from
its event loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from detour.model import Config, FaultItem, Route
from detour.policy import Avoidance, Choice
from detour.policy.steady import steady
from detour.strategy import Decision

T = TypeVar("T")

#: Avoidances whose answers a topic keeps at once (a broker's window opening and ending
#: moves between two); past it they are dropped and learnt again.
MAX_AVOIDANCES = 4


@dataclass(slots=True)
class TopicMemo(Generic[T]):
    """One topic's kept answers for one producer: valid from ``since`` to ``until`` (epoch
    ms, exclusive) while the table's select epoch is ``epoch``. A kept answer is the answer
    and how far it moves the topic counter."""

    route: Route
    config: Config
    #: whose memo this is (``choose_kept`` reads it in ``Memos.latest``)
    producer: str | None = None
    epoch: int = -1
    since: int = 0
    until: int = 0
    avoidance: Avoidance | None = None
    #: by the walk's start (counter % queues): the answer, None until one was kept
    answers: list[tuple[T, int] | None] = field(default_factory=list)
    #: the answers while none are kept: None for every start
    none: list[tuple[T, int] | None] = field(default_factory=list)
    #: the answers of each avoidance seen under this route and config
    by_avoidance: dict[Avoidance, list[tuple[T, int] | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.none = [None] * len(self.route.queues)
        self.answers = self.none

    def refresh(
        self, faults: Mapping[str, FaultItem], now_ms: int, producer: str | None, epoch: int
    ) -> None:
        """Work out the avoidance from ``now_ms`` on (``steady``), and the answers kept
        for it; none are kept while a draw or a probe may decide."""
        found = steady(self.route, faults, now_ms, self.config, producer)
        self.epoch, self.since, self.until = epoch, now_ms, found.until
        self.avoidance = found.avoidance
        if found.avoidance is None:
            self.answers = self.none
            return
        answers = self.by_avoidance.get(found.avoidance)
        if answers is None:
            if len(self.by_avoidance) >= MAX_AVOIDANCES:
                self.by_avoidance.clear()
            answers = [None] * len(self.route.queues)
            self.by_avoidance[found.avoidance] = answers
        self.answers = answers

    def keep(self, start: int, choice: Choice, answer: T, counter: int) -> None:
        """Keep ``answer`` (``choice``, decided with ``counter``) for walks starting at
        ``start``, unless it may not repeat: pickOneAtLeast (its queue depends on the
        counter), a probe, a keyed answer, or an avoidance other than the one worked out
        (it then is no answer ``steady`` vouches for)."""
        if (
            choice.selection.decision is Decision.PICK_ONE_AT_LEAST
            or choice.probe is not None
            or choice.ordered is not None
            or self.avoidance is None
            or choice.avoidance != self.avoidance
        ):
            return
        self.answers[start] = (answer, choice.selection.next_counter - counter)


class Memos(Generic[T]):
    """A table copy's kept answers, by topic and producer (each producer's own windows may
    give it its own avoidance). Bounded: past ``cap`` pairs they are all dropped and learnt
    again, so a stream of new producer names costs decisions, never memory.

    A store, not a judge: whether a memo may answer is ``detour.selector.choose_kept``'s
    rule, in one place. ``latest`` is the memo last used for each topic, whatever its
    producer, so that the select's common case finds it with one lookup by the topic name
    (a cached client has one producer; the pair key costs a tuple and its hash per select).
    """

    def __init__(self, cap: int = 1024) -> None:
        self.cap = cap
        self._by: dict[tuple[str, str | None], TopicMemo[T]] = {}
        #: topic -> the memo last used for it (one of ``_by``'s; at most one per topic)
        self.latest: dict[str, TopicMemo[T]] = {}

    def __len__(self) -> int:
        return len(self._by)

    def get(self, topic: str, producer: str | None) -> TopicMemo[T] | None:
        """The memo kept for ``producer``'s selects of ``topic``, made the topic's latest;
        None when there is none. Valid or not: that is the caller's to judge."""
        memo = self._by.get((topic, producer))
        if memo is not None:
            self.latest[topic] = memo
        return memo

    def renew(
        self,
        route: Route,
        config: Config,
        faults: Mapping[str, FaultItem],
        now_ms: int,
        producer: str | None,
        epoch: int,
    ) -> TopicMemo[T]:
        """The memo of ``route`` for ``producer`` worked out again at ``now_ms`` on a table
        at select epoch ``epoch`` (the caller found it no longer valid, or none): new when
        the route or the config is another object than the one it was kept for."""
        topic = route.topic
        key = (topic, producer)
        memo = self._by.get(key)
        if memo is None or memo.route is not route or memo.config is not config:
            if memo is None and len(self._by) >= self.cap:
                self.clear()
            memo = self._by[key] = TopicMemo(route, config, producer)
        memo.refresh(faults, now_ms, producer, epoch)
        self.latest[topic] = memo
        return memo

    def clear(self) -> None:
        self._by.clear()
        self.latest.clear()
