"""``POST /select`` on a replica's view: the route lookup, then the one select
(``detour.selector``, which the SDK's in-process selects run too): a first attempt on a
registered route from the answers kept while they provably repeat (``choose_kept``), any
other with ``choose_on``."""

from __future__ import annotations

from collections.abc import Sequence

from detour.decide import Ask
from detour.model import Queue, Route
from detour.policy import Choice
from detour.selector import choose_kept, choose_on
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
        if last_broker is None and sharding_key is None and route.queues:
            return route, choose_kept(view, route, producer, view.now_ms(), _as_is)
    return route, choose_on(view, route, Ask(last_broker, producer, sharding_key))


def _as_is(route: Route, choice: Choice) -> Choice:
    """The service keeps the choice itself: its answer is rendered per request (``degraded``
    and the metrics are of the moment)."""
    return choice
