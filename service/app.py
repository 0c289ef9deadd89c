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
from typing import TypedDict

from fastapi import FastAPI

from service import detector
from service.api import admin, events, health, reports, routes, select, status, stream
from service.api.contract import included
from service.api.errors import install_error_handlers
from service.api.metrics_listener import metrics_refusal, open_metrics_listener
from service.api.telemetry import prepare_namespaces
from service.auth import TokenTable, load_tokens
from service.edge.bounds import bound_names, install_bounds
from service.edge.state import Edge
from service.edge.wiring import install_edge
from service.settings import Settings
from service.store import FaultStore, StoreOptions, open_store, with_redis_password
from service.store.connect import describe_redis_url

log = logging.getLogger("detour")


class State(TypedDict):
    #: The store of the open namespace; with tokens, the Guard replaces it per request.
    store: FaultStore
    #: Every namespace's store, by namespace.
    stores: dict[str, FaultStore]
    #: The HTTP edge: the server protocol's bounds, the shedder, the direct lane
    #: (service/edge/protocol.py reads it as ``EDGE_STATE``).
    edge: Edge


def _describe(settings: Settings) -> str:
    if not settings.redis_url:
        return "store=memory (embedded, this process only)"
    return (
        f"store=redis at {describe_redis_url(settings.redis_url)} "
        f"namespace={settings.namespace} prefix={settings.redis_prefix}"
    )


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
    refusal = metrics_refusal(settings, tokens)
    if refusal:
        raise ValueError(refusal)
    namespaces = tokens.namespaces if tokens else [settings.namespace]
    edge: Edge | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[State]:
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
        scrapes = None
        try:
            assert edge is not None
            # GET /metrics on an address of its own (the sidecar's pod IP), when configured.
            scrapes = await open_metrics_listener(settings, tokens, app.state.exposition, stores)
            yield {"store": stores[namespaces[0]], "stores": stores, "edge": edge}
        finally:
            if scrapes is not None:
                await scrapes.close()
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
        # `/select/` is a path Detour does not have (404 in the Error shape), not a 307 to
        # a Location built from the client's own Host header.
        redirect_slashes=False,
        # Routes that need a token (when tokens are configured) declare it, for the contract.
        routes=list(
            included(
                tuple(m.router for m in (select, reports, routes, stream, admin, events)),
                tuple(m.router for m in (health, status)),
            )
        ),
    )
    install_bounds(app, settings)
    install_error_handlers(app)
    # Two ways in: the routes above, and the direct lane for /select and /report-latency.
    edge = install_edge(app, settings, tokens)
    # A report batch paces itself while other requests arrive (service/api/pacing.py).
    app.state.batches.arrivals = lambda: edge.requests_read
    return app
