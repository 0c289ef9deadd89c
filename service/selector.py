"""``POST /select`` on a replica's view: the route lookup, then the one select
(``detour.selector``, which the SDK's in-process selects run too): a first attempt on a
registered route from the answers kept while they provably repeat (``choose_kept``), any
other with ``choose_on``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from detour.decide import Ask
from detour.model import Queue, Route
from detour.policy import Choice
from detour.selector import choose_kept, choose_on
from detour.view import TableView
from service.errors import NotFound

T = TypeVar("T")


def choose_rendered(
    view: TableView,
    topic: str,
    inline: Sequence[Queue] | None,
    last_broker: str | None,
    producer: str | None,
    sharding_key: str | None,
    render: Callable[[Route, Choice], T],
) -> tuple[Route, T]:
    """The choice for one select, rendered by ``render``; raises NotFound when the topic
    has no route and no inline queues were given. A first attempt on a registered route
    is ``choose_kept``'s, its rendered answer kept with the choice: rendered once, not
    per select."""
    if inline:
        route = Route.from_queues(topic, inline)
    else:
        found = view.routes.get(topic)
        if found is None:
            raise NotFound(f"no route for topic {topic!r}", field="topic")
        route = found
        if last_broker is None and sharding_key is None and route.queues:
            return route, choose_kept(view, route, producer, view.now_ms(), render)
    return route, render(route, choose_on(view, route, Ask(last_broker, producer, sharding_key)))
