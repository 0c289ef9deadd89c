"""POST /report-latency: a producer tells how a send went; one atomic store write."""

from __future__ import annotations

import math

from fastapi import APIRouter

from service.api.deps import ERRORS, UNAVAILABLE, StoreDep
from service.schemas import ReportRequest, ReportResponse

router = APIRouter(tags=["reports"])


@router.post(
    "/report-latency",
    response_model=ReportResponse,
    responses={**ERRORS, **UNAVAILABLE},
    summary="Report a send's latency or failure",
)
async def report_latency(body: ReportRequest, store: StoreDep) -> ReportResponse:
    latency = math.floor(body.latency_ms)
    out = await store.report(body.broker_name, latency, body.isolation)
    return ReportResponse(
        broker_name=out.broker_name,
        latency_ms=out.latency_ms,
        not_available_duration_ms=out.not_available_duration_ms,
        available_at=out.available_at,
    )
