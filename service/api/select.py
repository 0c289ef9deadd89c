"""POST /select: the hot path, answered from this replica's view without a store round trip."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import ERRORS, StoreDep, not_found
from service.model import Queue
from service.schemas import SelectRequest, SelectResponse
from service.selector import choose

router = APIRouter(tags=["select"])


@router.post(
    "/select",
    response_model=SelectResponse,
    responses={**ERRORS, **not_found("Unknown topic.")},
    summary="Choose a queue for one send attempt",
)
async def select(body: SelectRequest, store: StoreDep) -> SelectResponse:
    inline = [Queue(q.broker_name, q.queue_id) for q in body.queues] if body.queues else None
    route, sel = choose(store.view, body.topic, inline, body.last_broker_name)
    return SelectResponse(
        topic=body.topic,
        broker_name=sel.queue.broker_name,
        queue_id=sel.queue.queue_id,
        address=route.addresses.get(sel.queue.broker_name),
        decision=sel.decision.value,
        avoided_brokers=list(sel.avoided_brokers),
    )
