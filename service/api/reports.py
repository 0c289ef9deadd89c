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
    """Record a send's latency, or its failure (`isolation: true`), for a broker.

    Duration: scan `latencyMax` from the top; the first `i` with
    `latency >= latencyMax[i]` gives `notAvailableDuration[i]`, else 0. A failure counts
    as `isolationLatencyMs` (default 30000 ms, so 600 s). The update, atomic on the
    store's clock `now`: `currentLatencyMs := latencyMs`; the window end becomes
    `max(old end, now + duration)`, or `now + duration` with `lastReportWins`. With
    avoidance off the report is accepted and changes nothing. One store round trip.
    """
    latency = math.floor(body.latency_ms)
    out = await store.report(body.broker_name, latency, body.isolation)
    return ReportResponse(
        broker_name=out.broker_name,
        latency_ms=out.latency_ms,
        not_available_duration_ms=out.not_available_duration_ms,
        available_at=out.available_at,
    )
