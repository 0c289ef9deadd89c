"""POST /select: the hot path, answered from this replica's view without a store round trip."""

from __future__ import annotations

from typing import NamedTuple

from fastapi import APIRouter, Request, Response

from detour.model import Queue, Route
from detour.policy import Choice
from service.api.caller import principal_of, voter
from service.api.deps import ERRORS, UNAVAILABLE, StoreDep, not_found
from service.api.telemetry import observe_policy, observe_select
from service.errors import NotFound
from service.schemas import SelectRequest, SelectResponse
from service.selector import choose_rendered
from service.store import FaultStore

router = APIRouter(tags=["select"])


@router.post(
    "/select",
    response_model=SelectResponse,
    responses={**ERRORS, **not_found("Unknown topic."), **UNAVAILABLE},
    summary="Choose a queue for one send attempt",
)
async def select(body: SelectRequest, store: StoreDep, request: Request) -> Response:
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

    **Beyond RocketMQ** (docs/policy.md; every knob is in the config and off by default):
    `shardingKey` picks `queues[crc32(key) % n]` (`ordered`); `producer` adds the windows
    of this producer's own failures short of `isolationQuorum` and slow answers short of
    `latencyQuorum`; `maxAvoidedPercent`,
    `panicThresholdPercent` and `enforcementPercent` decide which open windows are
    obeyed (`unenforcedBrokers`, `panic`, `dryRun`); `selection: p2c-ewma` picks the
    faster of two random available queues instead of walking round-robin.
    """
    # The identity the producer's reports vote with (the token's when tokens are on).
    producer = voter(principal_of(request.scope["state"]), body.producer) or None
    return Response(answer(store, body, producer), media_type="application/json")


class Rendered(NamedTuple):
    """A choice and its answer's JSON text, split around ``degraded``: the one field that
    is of the moment (the store's state), so that a kept choice is rendered once."""

    choice: Choice
    head: str
    tail: str

    def text(self, degraded: bool) -> str:
        return self.head + ("true" if degraded else "false") + self.tail


def rendered(route: Route, choice: Choice) -> Rendered:
    """The answer to a select that chose ``choice`` on ``route``, but for ``degraded``."""
    sel, av = choice.selection, choice.avoidance
    queue = sel.queue
    address = route.addresses.get(queue.broker_name)
    address_json = f'"{address}"' if address else "null"
    # Every string here matched NAME_PATTERN or the address pattern on the way in
    # (letters, digits, ``_.%|-:[]``): nothing to escape, so the JSON is written directly.
    avoided = ",".join(f'"{b}"' for b in sel.avoided_brokers)
    unenforced = ",".join(f'"{b}"' for b in av.unenforced)
    ordered = f'"{choice.ordered}"' if choice.ordered else "null"
    head = (
        f'{{"topic":"{route.topic}","brokerName":"{queue.broker_name}",'
        f'"queueId":{queue.queue_id},"address":{address_json},'
        f'"decision":"{sel.decision.value}","avoidedBrokers":[{avoided}],'
        f'"degraded":'
    )
    tail = (
        f',"panic":{"true" if av.panic else "false"},'
        f'"dryRun":{"true" if av.dry_run else "false"},'
        f'"unenforcedBrokers":[{unenforced}],"ordered":{ordered},'
        f'"probe":{"true" if choice.probe else "false"}}}'
    )
    return Rendered(choice, head, tail)


def answer(store: FaultStore, body: SelectRequest, producer: str | None) -> str:
    """The select's answer as JSON text; raises NotFound (counted) for an unknown topic.

    Synchronous: the server's direct lane (service/edge/direct.py) calls it too."""
    inline = [Queue(q.broker_name, q.queue_id) for q in body.queues] if body.queues else None
    view = store.view
    try:
        _, kept = choose_rendered(
            view,
            body.topic,
            inline,
            body.last_broker_name,
            producer,
            body.sharding_key,
            rendered,
        )
    except NotFound:
        observe_select(view.namespace, None)
        raise
    choice = kept.choice
    observe_select(view.namespace, choice.selection)
    observe_policy(view.namespace, choice)
    return kept.text(store.degraded)
