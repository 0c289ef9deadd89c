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
from detour.memo import TopicMemo
from detour.model import Route
from detour.policy import Choice, probation_on
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

    The common case, a memo still valid and an answer kept for the counter's start, is
    two calls (``Memos.fresh``, ``SelectorState.step_kept``): a producer thread that
    slept runs its first microseconds cold, and every call costs it (docs/BENCHMARKS.md,
    "Cached decide in fewer calls")."""
    fresh = view.memos.fresh(route, view.config, now_ms, producer, view.select_epoch)
    if fresh is not None:
        hit = view.selector.step_kept(route.topic, fresh.answers)
        if hit is not None:
            return hit  # type: ignore[no-any-return]
    memo: TopicMemo[T] = view.memos.current(
        route, view.config, view.faults, now_ms, producer, view.select_epoch
    )
    topic = route.topic
    counter = view.counter(topic)
    start = counter % len(route.queues)
    kept = memo.answers[start]
    if kept is not None:
        view.set_counter(topic, counter + kept[1])
        return kept[0]
    choice = choose_on(view, route, Ask(None, producer, None), None, now_ms)
    answer = render(route, choice)
    memo.keep(start, choice, answer, counter)
    return answer
