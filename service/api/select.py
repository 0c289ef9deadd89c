"""POST /select: the hot path, answered from this replica's view without a store round trip."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError

from service.api.deps import ERRORS, not_found
from service.model import Queue
from service.schemas import SelectRequest, SelectResponse
from service.selector import choose
from service.store import FaultStore

_REQUEST = TypeAdapter(SelectRequest)
#: Models the OpenAPI document must carry though no route parameter declares them.
SCHEMAS = (SelectRequest,)

router = APIRouter(tags=["select"])


@router.post(
    "/select",
    response_model=SelectResponse,
    responses={**ERRORS, **not_found("Unknown topic.")},
    summary="Choose a queue for one send attempt",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/SelectRequest"}}
            },
        }
    },
)
async def select(request: Request) -> Response:
    """Choose the queue for one send attempt (RocketMQ's `selectOneMessageQueue`).

    The queue list is the route's, ordered by brokerName then queueId (or the inline
    `queues`). A broker is *avoided* while `now < availableAt` of its fault item.

    **Avoidance on** (`sendLatencyFaultEnable`): walk the list round-robin from the
    topic's counter on this replica; every probed queue advances the counter, so an
    avoided broker's share spreads evenly over the rest.
    1. The first queue whose broker is available and is not `lastBrokerName`:
       `decision: available`.
    2. Else the first available queue even on `lastBrokerName`: `decision: available`.
    3. Else *pickOneAtLeast*: rank the route's brokers that have fault items by
       (available first, lower `currentLatencyMs`, earlier `availableAt`, name) at one
       `now`, keep the better half (`n // 2`, at least 1), take broker `counter % half`
       and its queue `(counter // half) % queues`: `decision: pick_one_at_least`.

    **Avoidance off**: round-robin, skipping `lastBrokerName` when another broker
    exists: `decision: round_robin`.

    A select always returns a queue when the route has one. It is answered from this
    replica's copy of the table, with no store round trip.
    """
    # The hot path skips FastAPI's body and response machinery: the body is
    # validated by pydantic-core straight from bytes and the answer is written
    # directly. The models still define the contract (openapi.yaml, tests).
    try:
        body = _REQUEST.validate_json(await request.body() or b"null")
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        ) from None
    inline = [Queue(q.broker_name, q.queue_id) for q in body.queues] if body.queues else None
    store: FaultStore = request.state.store
    route, sel = choose(store.view, body.topic, inline, body.last_broker_name)
    queue = sel.queue
    return Response(
        json.dumps(
            {
                "topic": body.topic,
                "brokerName": queue.broker_name,
                "queueId": queue.queue_id,
                "address": route.addresses.get(queue.broker_name),
                "decision": sel.decision.value,
                "avoidedBrokers": sel.avoided_brokers,
                "degraded": store.degraded,
            },
            separators=(",", ":"),
        ),
        media_type="application/json",
    )
