"""``POST /select`` on a replica's view: the route lookup, then the one select
(``detour.selector.choose_on``, which the SDK's in-process selects run too)."""

from __future__ import annotations

from collections.abc import Sequence

from detour.decide import Ask
from detour.model import Queue, Route
from detour.policy import Choice
from detour.selector import choose_on
from detour.view import TableView
from service.errors import NotFound


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
