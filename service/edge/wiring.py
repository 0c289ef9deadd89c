"""The edge put around the app: its middleware in order, and the ``Edge`` the server
protocol finds in the lifespan state. service/app.py calls ``install_edge`` once."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.routing import APIRoute, iter_route_contexts

from service.api.telemetry import RequestTimer
from service.auth import TokenTable
from service.edge.bodies import BodyLimit, JsonBodies
from service.edge.connections import connection_bound
from service.edge.cpu_share import CpuShare
from service.edge.direct import PATHS, DirectLane
from service.edge.guard import Guard
from service.edge.hosts import HostNames
from service.edge.shedding import Saturation, Shedder
from service.edge.state import Edge, EdgeLimits
from service.settings import Settings


def install_edge(app: FastAPI, settings: Settings, tokens: TokenTable | None) -> Edge:
    """Add the edge's middleware to ``app`` (its routes and exception handlers in place)
    and return the process's ``Edge``, for the lifespan state."""
    shedder = Shedder(
        None,
        max_in_flight=settings.max_in_flight,
        max_queue_wait_ms=settings.max_queue_wait_ms,
        turn_budget_ms=settings.turn_budget_ms,
        saturation=Saturation(CpuShare(settings.workers).cores),
    )
    edge = Edge(edge_limits(settings, bool(tokens)), shedder, tokens=tokens or None)
    if settings.direct_lane:
        routes = {
            r.path: r
            for r in (c.original_route for c in iter_route_contexts(app.routes))
            if isinstance(r, APIRoute) and r.path in PATHS and "POST" in (r.methods or ())
        }
        edge.direct = DirectLane(
            routes, settings.max_body_bytes, app.exception_handlers, tokens or None
        )
    # Innermost first: the JSON check, the request timer, the body limit (ahead of the
    # timer: an over-long body is refused untimed), the token guard (before any body is
    # read: a request without a valid token costs one hash), the shedder (outermost: a
    # refused request costs as little as possible, and the protocol reaches it through
    # the lifespan state).
    app.add_middleware(JsonBodies)
    app.add_middleware(RequestTimer)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        overrides={"/report-latency:batch": settings.max_batch_body_bytes},
    )
    if tokens:
        app.add_middleware(Guard, tokens=tokens)
    app.add_middleware(shedder.wrap)
    return edge


def edge_limits(settings: Settings, has_tokens: bool) -> EdgeLimits:
    """The protocol's bounds. Host names are checked on an open Detour (a rebinding page
    could drive it), and with tokens only when configured (a page cannot present one)."""
    check_hosts = not has_tokens or settings.allowed_hosts is not None
    max_connections = connection_bound(settings.max_connections)
    return EdgeLimits(
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        max_body_bytes=max(settings.max_body_bytes, settings.max_batch_body_bytes),
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        max_connections=max_connections,
        max_connections_per_peer=min(settings.max_connections_per_peer, max_connections),
        unproven_idle_s=settings.unproven_idle_s,
        socket_buffer=settings.socket_buffer_bytes,
        stream_send_buffer=settings.stream_send_buffer_bytes,
        hosts=HostNames.parse(settings.allowed_hosts, settings.host) if check_hosts else None,
    )
