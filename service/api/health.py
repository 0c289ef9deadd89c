"""Liveness and readiness for Kubernetes probes."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service import metrics
from service.api.deps import StoreDep
from service.schemas import ErrorBody, Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="The process is alive")
async def healthz(store: StoreDep) -> Health:
    return Health(status="ok", store=store.kind, degraded=store.degraded)  # type: ignore[arg-type]


@router.get(
    "/readyz",
    response_model=Health,
    responses={503: {"model": ErrorBody, "description": "Store not reachable."}},
    summary="The store is reachable and this replica's table is synced",
)
async def readyz(store: StoreDep) -> Health:
    """Ready once the replica holds a table. A Redis outage after that keeps it ready
    (`degraded: true`): selects go on from the replica's copy and reports are journaled,
    so Kubernetes should keep sending producers here."""
    await store.ping()
    return Health(status="ready", store=store.kind, degraded=store.degraded)  # type: ignore[arg-type]


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics",
    responses={
        200: {
            "description": "Prometheus text exposition format.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
async def prometheus(store: StoreDep) -> Response:
    """Counters of this process (all workers' when several run) and the table's state."""
    return Response(metrics.exposition(store.view, store.degraded), media_type=CONTENT_TYPE_LATEST)
