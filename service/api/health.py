"""Liveness and readiness for Kubernetes probes."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.api.contract import TOKEN
from service.api.deps import ERRORS, StoresDep
from service.api.exposition import Exposition
from service.schemas import ErrorBody, Health
from service.store import FaultStore

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="The process is alive")
async def healthz(stores: StoresDep) -> Health:
    return _health("ok", stores)


def _health(status: str, stores: dict[str, FaultStore]) -> Health:
    kind = next(iter(stores.values())).kind
    degraded = any(s.degraded for s in stores.values())
    return Health(status=status, store=kind, degraded=degraded)  # type: ignore[arg-type]


@router.get(
    "/readyz",
    response_model=Health,
    responses={503: {"model": ErrorBody, "description": "Store not reachable."}},
    summary="The store is reachable and this replica's table is synced",
)
async def readyz(stores: StoresDep) -> Health:
    """Ready once the replica holds a table. A Redis outage after that keeps it ready
    (`degraded: true`): selects go on from the replica's copy and reports are journaled,
    so Kubernetes should keep sending producers here."""
    for store in stores.values():
        await store.ping()
    return _health("ready", stores)


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics",
    dependencies=[TOKEN],
    responses={
        200: {
            "description": "Prometheus text exposition format.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        401: ERRORS[401],
        403: ERRORS[403],
    },
)
async def prometheus(request: Request, stores: StoresDep) -> Response:
    """Counters of this process (all workers' when several run) and every table's state.

    With tokens, a `metrics` (or `admin`) token is needed, and the scrape shows only its
    namespace's series (a `metrics` token for namespace `*`: all). Rendered at most once
    a second (`DETOUR_METRICS_CACHE_S`): a scrape sooner than that after the last one waits
    for the next rendering, which it shares with every scrape waiting by then."""
    exposition: Exposition = request.app.state.exposition
    principal = getattr(request.state, "principal", None)
    namespaces = None if principal is None else principal.scrape_namespaces()
    body = await exposition.text(stores, namespaces)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
