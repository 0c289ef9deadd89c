"""One select against a copy of the table: read the view, decide, advance the topic counter.

``choose_on`` is what ``POST /select`` runs on a replica's view once the route is known,
and what the SDK's in-process selects (cached mode and fail-open) run on their own copy:
both read the view here and decide in ``detour.decide``, so there is one decision,
whoever makes it. ``choose_kept`` answers a first attempt from the answers kept for it
(``detour.memo``) when they provably repeat, and decides with ``choose_on`` otherwise.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeVar

from detour.decide import NO_SCORES, Ask, Table, decide, draw
from detour.model import Route
from detour.policy import Choice, probation_on
from detour.selector_state import COUNTER_MASK
from detour.view import TableView

T = TypeVar("T")

#: The random source of the selects (the enforcement share, the p2c draws).
_rng = random.Random()


def choose_on(
    view: TableView,
    route: Route,
    ask: Ask,
    rng: random.Random | None = None,
    now_ms: int | None = None,
) -> Choice:
    """Decide one select of ``route`` on ``view``, then advance the topic's counter and
    note a probe handed out, as every decider does.

    ``rng`` draws what the config needs (``decide.draw``); the module's own by default.
    ``now_ms``: the view's clock, read by the caller (read here when None).
    Raises ValueError when the route has no queue.
    """
    config = view.config
    now = view.now_ms() if now_ms is None else now_ms
    topic = route.topic
    table = Table(
        route,
        config,
        view.faults,
        view.counter(topic),
        now,
        view.latency_scores if config.selection == "p2c-ewma" else NO_SCORES,
        view.free_probes(now) if probation_on(config) else (),
    )
    choice = decide(table, ask, draw(config, rng or _rng))
    if choice.probe is not None:
        view.probe_sent(choice.probe, now)
    view.set_counter(topic, choice.selection.next_counter)
    return choice


def choose_kept(
    view: TableView,
    route: Route,
    producer: str | None,
    now_ms: int,
    render: Callable[[Route, Choice], T],
) -> T:
    """One unkeyed first attempt (no last broker, no sharding key, the module's draws) of
    ``route``, which has queues, rendered by ``render``: the answer kept for the walk's
    start when one is (the counter moves as the decision moved it), else ``choose_on``'s,
    kept for the next select starting there when it may repeat.

    Such a select reads no draw when its answer is kept, so none is taken from the
    module's generator, which nobody reads in order.

    The rule of when a memo may answer is here and only here: it was worked out for this
    route object and config object, at this select epoch, and ``now_ms`` is in its
    window. The common case (the topic's latest memo is this producer's and valid, an
    answer is kept for the counter's start) makes no call at all: a producer thread that
    slept runs its first microseconds cold, and each call, lookup and object it touches
    then costs it (docs/BENCHMARKS.md, "Cached decide, one frame")."""
    topic = route.topic
    memos = view.memos
    memo = memos.latest.get(topic)
    if memo is None or memo.producer != producer:
        memo = memos.get(topic, producer)
    if (
        memo is not None
        and memo.epoch == view.select_epoch
        and memo.since <= now_ms < memo.until
        and memo.route is route
        and memo.config is view.config
    ):
        counters = view.selector.counters
        c = counters.get(topic)
        if c is not None:
            answers = memo.answers
            kept = answers[c % len(answers)]
            if kept is not None:
                del counters[topic]  # to the end: most recently used (the size does not change)
                counters[topic] = (c + kept[1]) & COUNTER_MASK
                return kept[0]  # type: ignore[no-any-return]
    else:
        memo = memos.renew(route, view.config, view.faults, now_ms, producer, view.select_epoch)
    counter = view.counter(topic)
    start = counter % len(route.queues)
    kept = memo.answers[start]
    if kept is not None:
        view.set_counter(topic, counter + kept[1])
        return kept[0]  # type: ignore[no-any-return]
    choice = choose_on(view, route, Ask(None, producer, None), None, now_ms)
    answer = render(route, choice)
    memo.keep(start, choice, answer, counter)
    return answer
