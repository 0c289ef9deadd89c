"""Topic routes: which brokers and how many queues each topic has."""

from __future__ import annotations

from fastapi import APIRouter, Response

from detour.model import BrokerRoute, Route
from service.api.deps import ERRORS, UNAVAILABLE, StoreDep, TopicPath, not_found
from service.api.render import route_out
from service.errors import NotFound
from service.schemas import RouteBody, RouteOut, RoutesOut

router = APIRouter(tags=["routes"])


@router.put(
    "/routes/{topic}",
    response_model=RouteOut,
    responses={**ERRORS, **UNAVAILABLE},
    summary="Register or replace a topic's route",
)
async def put_route(topic: TopicPath, body: RouteBody, store: StoreDep) -> RouteOut:
    route = Route.from_brokers(
        topic, (BrokerRoute(b.broker_name, b.write_queue_nums, b.address) for b in body.brokers)
    )
    await store.put_route(route)
    return route_out(route)


@router.get("/routes", response_model=RoutesOut, summary="List every route")
async def list_routes(store: StoreDep) -> RoutesOut:
    return RoutesOut(routes=[route_out(store.view.routes[t]) for t in sorted(store.view.routes)])


@router.get(
    "/routes/{topic}",
    response_model=RouteOut,
    responses={**ERRORS, **not_found("Unknown topic.")},
    summary="One topic's route",
)
async def get_route(topic: TopicPath, store: StoreDep) -> RouteOut:
    route = store.view.routes.get(topic)
    if route is None:
        raise NotFound(f"no route for topic {topic!r}", field="topic")
    return route_out(route)


@router.delete(
    "/routes/{topic}",
    status_code=204,
    response_class=Response,
    responses={**ERRORS, **not_found("Unknown topic."), **UNAVAILABLE},
    summary="Remove a route",
)
async def delete_route(topic: TopicPath, store: StoreDep) -> Response:
    if not await store.delete_route(topic):
        raise NotFound(f"no route for topic {topic!r}", field="topic")
    return Response(status_code=204)
