"""The answers of a topic's unkeyed selects, kept while they provably repeat.

A cached client decides every select in-process, most of them on a table that has not
changed in anything a select reads since the last lap of the route. ``steady`` says when
that holds (``detour.policy.steady``): then the answer of a select whose walk starts at
queue ``i`` is the answer the last one starting there got, and the select is a lookup
and a counter step instead of a decision. The answer kept is the one ``choose_on`` gave,
never one made up here, so both paths answer alike by construction; a test drives random
tables and configs through both (tests/test_client_memo.py).

Not thread-safe on its own: ``LocalTable`` calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from detour.client.values import SelectedQueue
from detour.model import Config, FaultItem, Route
from detour.policy import Avoidance, Choice
from detour.policy.steady import steady
from detour.strategy import Decision

#: A kept answer: what the select returns, and how far it moves the topic counter.
Answer = tuple[SelectedQueue, int]

#: Avoidances whose answers a topic keeps at once (a broker's window opening and ending
#: moves between two); past it they are dropped and learnt again.
MAX_AVOIDANCES = 4


@dataclass(slots=True)
class TopicMemo:
    """One topic's kept answers: valid from ``since`` to ``until`` (epoch ms, exclusive)
    while the table's ``epoch`` is the one they were kept at."""

    route: Route
    config: Config
    epoch: int = -1
    since: int = 0
    until: int = 0
    avoidance: Avoidance | None = None
    #: by the walk's start (counter % queues): the answer, None until one was kept
    answers: list[Answer | None] = field(default_factory=list)
    #: the answers while none are kept: None for every start
    none: list[Answer | None] = field(default_factory=list)
    #: the answers of each avoidance seen under this route and config
    by_avoidance: dict[Avoidance, list[Answer | None]] = field(default_factory=dict)

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

    def keep(self, start: int, choice: Choice, answer: SelectedQueue, counter: int) -> None:
        """Keep ``choice`` (decided with ``counter``) as the answer of walks starting at
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
