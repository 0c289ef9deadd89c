"""A select against a copy of the table: route lookup, the one decision, the topic counter.

``choose`` is what ``POST /select`` runs on a replica's view; ``choose_on`` is the part
after the route lookup, shared with the SDK's in-process selects (cached mode and
fail-open), which keep the same kind of view. Both read the view here and decide in
``service.decide``, so there is one decision, whoever makes it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from service.decide import NO_SCORES, Ask, Table, decide, draw
from service.errors import NotFound
from service.model import Queue, Route
from service.policy import Choice, probation_on
from service.view import TableView

#: The random source of the service's selects (the enforcement share, the p2c draws).
_rng = random.Random()


def choose_on(view: TableView, route: Route, ask: Ask, rng: random.Random | None = None) -> Choice:
    """Decide one select of ``route`` on ``view``, then advance the topic's counter and
    note a probe handed out, as every decider does.

    ``rng`` draws what the config needs (``decide.draw``); the module's own by default.
    Raises ValueError when the route has no queue.
    """
    config = view.config
    now = view.now_ms()
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


def choose(
    view: TableView,
    topic: str,
    inline: Sequence[Queue] | None,
    last_broker: str | None,
    producer: str | None = None,
    sharding_key: str | None = None,
) -> tuple[Route, Choice]:
    """Raises NotFound when the topic has no route and no inline queues were given."""
    if inline:
        route = Route.from_queues(topic, inline)
    else:
        found = view.routes.get(topic)
        if found is None:
            raise NotFound(f"no route for topic {topic!r}", field="topic")
        route = found
    return route, choose_on(view, route, Ask(last_broker, producer, sharding_key))
