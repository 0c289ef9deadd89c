"""One select against a copy of the table: read the view, decide, advance the topic counter.

``choose_on`` is what ``POST /select`` runs on a replica's view once the route is known,
and what the SDK's in-process selects (cached mode and fail-open) run on their own copy:
both read the view here and decide in ``detour.decide``, so there is one decision,
whoever makes it.
"""

from __future__ import annotations

import random

from detour.decide import NO_SCORES, Ask, Table, decide, draw
from detour.model import Route
from detour.policy import Choice, probation_on
from detour.view import TableView

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
