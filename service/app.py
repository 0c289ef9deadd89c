"""The application factory: wiring only, nothing built at import time."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any, TypedDict

from fastapi import FastAPI
from pydantic import BaseModel

from service import detector
from service.api import admin, events, health, reports, routes, select, status, stream
from service.api.errors import install_error_handlers
from service.api.fast import HotLane, mount_fast
from service.api.telemetry import RequestTimer, prepare_namespaces
from service.auth import Principal, Role, TokenTable, load_tokens, requires_token
from service.edge.bodies import BodyLimit, HostNames, JsonBodies, connection_bound
from service.edge.bounds import bound_names, install_bounds
from service.edge.cpu_share import CpuShare
from service.edge.direct import DirectLane
from service.edge.guard import Guard
from service.edge.protocol import Edge, EdgeLimits
from service.edge.shedding import Saturation, Shedder
from service.schemas import ReportRequest, SelectRequest
from service.settings import Settings
from service.store import FaultStore, StoreOptions, open_store, with_redis_password
from service.store.connect import describe_redis_url

log = logging.getLogger("detour")


class State(TypedDict):
    #: The store of the open namespace; with tokens, the Guard replaces it per request.
    store: FaultStore
    #: Every namespace's store, by namespace.
    stores: dict[str, FaultStore]
    #: The server protocol's bounds and the shedder (service/protocol.py reads it as
    #: ``EDGE_STATE``).
    edge: Edge


def _describe(settings: Settings) -> str:
    if not settings.redis_url:
        return "store=memory (embedded, this process only)"
    return (
        f"store=redis at {describe_redis_url(settings.redis_url)} "
        f"namespace={settings.namespace} prefix={settings.redis_prefix}"
    )


def _document_security(doc: dict[str, Any]) -> None:
    """Bearer tokens (service/auth.py): required when the deployment has tokens, so each
    call lists the token and, for an open deployment, no security as alternatives; the
    open paths list none. ``x-detour-role`` names the least role that may call."""
    doc["components"]["securitySchemes"] = {
        "bearerToken": {
            "type": "http",
            "scheme": "bearer",
            "description": "A token from the deployment's tokens file (docs/security.md); "
            "needed only when tokens are configured.",
        }
    }
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if not requires_token(path):
                op["security"] = []
                continue
            op["security"] = [{"bearerToken": []}, {}]
            op["x-detour-role"] = next(
                r.value
                for r in (Role.PRODUCER, Role.METRICS, Role.ADMIN)
                if Principal("", r, "").may(method.upper(), path)
            )


def _document_extra_schemas(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Add models that routes reading raw bodies reference to the OpenAPI components."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = generate()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(
                    by_alias=True, ref_template="#/components/schemas/{model}"
                )
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            doc["components"]["schemas"] = dict(sorted(schemas.items()))
            _document_security(doc)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _before_stop_signal(callback: Callable[[], None]) -> Callable[[], None]:
    """Run ``callback`` on SIGTERM/SIGINT before the server's own handler; returns undo.

    The server waits for requests in flight before the lifespan's shutdown runs, and
    a push stream never finishes by itself: without this, every stop would wait the
    whole grace period. Signals reach only the main thread; elsewhere (tests driving
    the app in a thread) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(sig: int, frame: FrameType | None) -> None:
        loop.call_soon_threadsafe(callback)
        prev = previous[signal.Signals(sig)]
        if callable(prev):
            prev(sig, frame)

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, prev in previous.items():
            signal.signal(sig, prev)

    return restore


def create_app(settings: Settings | None = None, tokens: TokenTable | None = None) -> FastAPI:
    """The app; ``tokens`` default to the settings' (raises ValueError when they are invalid,
    or when the Redis password file cannot be read)."""
    settings = with_redis_password(settings or Settings())
    tokens = load_tokens(settings) if tokens is None else tokens
    namespaces = tokens.namespaces if tokens else [settings.namespace]
    # Outermost: a refused request costs as little as possible and is not timed. The
    # protocol reaches it through the lifespan state.
    shedder = Shedder(
        None,
        max_in_flight=settings.max_in_flight,
        max_queue_wait_ms=settings.max_queue_wait_ms,
        turn_budget_ms=settings.turn_budget_ms,
        saturation=Saturation(CpuShare(settings.workers).cores),
    )
    edge = Edge(_edge_limits(settings, bool(tokens)), shedder)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[State]:
        prepare_namespaces(namespaces)
        stores: dict[str, FaultStore] = {}
        try:
            for ns in namespaces:
                stores[ns] = await open_store(StoreOptions.of(settings), ns)
        except BaseException:
            for opened in stores.values():
                await opened.close()
            raise

        bound_names(stores.values(), settings)

        def stop_listeners() -> None:
            for s in stores.values():
                s.view.stop_listeners()

        restore_signals = _before_stop_signal(stop_listeners)
        log.info("detour ready: %s", _describe(settings))
        if tokens:
            log.info("tokens required; namespaces: %s", ", ".join(namespaces))
        else:
            log.warning(
                "no tokens configured: every request is served, on namespace %r; "
                "listening on %s only",
                settings.namespace,
                settings.host,
            )
        # Start-up objects live for the whole process; keeping them out of the
        # cyclic GC's generations removes its pauses from the request path.
        gc.collect()
        gc.freeze()
        # The active detector runs beside each namespace's table (off until the config
        # enables it; one replica at a time checks, by a lease in the store).
        detectors = [asyncio.create_task(detector.run(s)) for s in stores.values()]
        try:
            yield {"store": stores[namespaces[0]], "stores": stores, "edge": edge}
        finally:
            for task in detectors:
                task.cancel()
            await asyncio.gather(*detectors, return_exceptions=True)
            restore_signals()
            for s in stores.values():
                await s.close()

    app = FastAPI(
        title="Detour",
        version="0.1.0",
        summary="A shared broker fault table for RocketMQ-style producers.",
        description="Producers ask which queue to send to (`POST /select`) and report how each "
        "send went (`POST /report-latency`); brokers that were slow or failed are avoided for "
        "a while, for every producer that shares the table. See docs/semantics.md.",
        lifespan=lifespan,
    )
    install_bounds(app, settings)
    _document_extra_schemas(app, (SelectRequest, ReportRequest))
    install_error_handlers(app)
    for module in (select, reports, routes, stream, admin, events, health, status):
        app.include_router(module.router)
    hot = mount_fast(app, (("/select", select.select), ("/report-latency", reports.report_latency)))
    if settings.direct_lane:
        # The same two routes answered by the protocol when they never wait.
        edge.direct = DirectLane(
            hot, settings.max_body_bytes, app.exception_handlers, tokens or None
        )
    app.add_middleware(JsonBodies)
    app.add_middleware(RequestTimer)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        overrides={"/report-latency:batch": settings.max_batch_body_bytes},
    )
    # The hot routes in one pass, with the same steps as the three above and the
    # exception middleware and router below them (service/api/fast.py).
    app.add_middleware(
        HotLane, routes=hot, max_bytes=settings.max_body_bytes, handlers=app.exception_handlers
    )
    if tokens:
        # Before the body is read: a request without a valid token costs one hash.
        app.add_middleware(Guard, tokens=tokens)
    app.add_middleware(shedder.wrap)
    return app


def _edge_limits(settings: Settings, has_tokens: bool) -> EdgeLimits:
    """The protocol's bounds. Host names are checked on an open Detour (a rebinding page
    could drive it), and with tokens only when configured (a page cannot present one)."""
    check_hosts = not has_tokens or settings.allowed_hosts is not None
    return EdgeLimits(
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        max_connections=connection_bound(settings.max_connections),
        stream_send_buffer=settings.stream_send_buffer_bytes,
        hosts=HostNames.parse(settings.allowed_hosts, settings.host) if check_hosts else None,
    )
