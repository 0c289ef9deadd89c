"""A select against this replica's view: route lookup, the pure strategy, the topic counter."""

from __future__ import annotations

from collections.abc import Sequence

from service import metrics, strategy
from service.errors import NotFound
from service.model import Queue, Route
from service.view import TableView


def choose(
    view: TableView, topic: str, inline: Sequence[Queue] | None, last_broker: str | None
) -> tuple[Route, strategy.Selection]:
    """Raises NotFound when the topic has no route and no inline queues were given."""
    if inline:
        route = Route.from_queues(topic, inline)
    else:
        found = view.routes.get(topic)
        if found is None:
            metrics.observe_select(view.namespace, None)
            raise NotFound(f"no route for topic {topic!r}", field="topic")
        route = found
    selection = strategy.select(
        route,
        view.counter(topic),
        view.faults,
        view.now_ms(),
        last_broker,
        view.config.send_latency_fault_enable,
    )
    view.set_counter(topic, selection.next_counter)
    metrics.observe_select(view.namespace, selection)
    return route, selection
