"""A select against this replica's view: route lookup, the pure policy, the topic counter."""

from __future__ import annotations

import random
from collections.abc import Sequence

from service import policy
from service.errors import NotFound
from service.model import Queue, Route
from service.view import TableView

_rng = random.Random()
#: What a select gets when no rule of its config needs a random value.
_NO_DRAWS = policy.Draws()


def choose(
    view: TableView,
    topic: str,
    inline: Sequence[Queue] | None,
    last_broker: str | None,
    producer: str | None = None,
    sharding_key: str | None = None,
) -> tuple[Route, policy.Choice]:
    """Raises NotFound when the topic has no route and no inline queues were given.

    The random draws the policy may use (the enforcement share, the two p2c
    choices) are made here, so ``service.policy`` stays deterministic.
    """
    if inline:
        route = Route.from_queues(topic, inline)
    else:
        found = view.routes.get(topic)
        if found is None:
            raise NotFound(f"no route for topic {topic!r}", field="topic")
        route = found
    config = view.config
    now = view.now_ms()
    draws = (
        policy.Draws(
            _rng.random() if config.enforcement_percent < 100 else 0.0,
            _rng.getrandbits(32),
            _rng.getrandbits(32),
        )
        if config.enforcement_percent < 100 or config.selection == "p2c-ewma"
        else _NO_DRAWS
    )
    choice = policy.choose(
        route,
        view.counter(topic),
        view.faults,
        now,
        last_broker,
        config,
        draws,
        producer,
        sharding_key,
        view.latency_scores if config.selection == "p2c-ewma" else None,
        view.free_probes(now) if config.probe_on_expiry else (),
    )
    if choice.probe is not None:
        view.probe_sent(choice.probe, now)
    view.set_counter(topic, choice.selection.next_counter)
    return route, choice
