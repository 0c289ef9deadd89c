"""POST /report-latency and its batch form: producers tell how sends went."""

from __future__ import annotations

import math

from fastapi import APIRouter

from service.api.deps import ERRORS, UNAVAILABLE, StoreDep
from service.api.render import report_out
from service.schemas import BatchReportRequest, BatchReportResponse, ReportRequest, ReportResponse
from service.store import ReportIn

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
    report = ReportIn(body.broker_name, math.floor(body.latency_ms), body.isolation)
    (out,) = await store.report_many([report])
    return report_out(out)


@router.post(
    "/report-latency:batch",
    response_model=BatchReportResponse,
    responses={**ERRORS, **UNAVAILABLE},
    summary="Report up to 1,000 sends at once",
)
async def report_latency_batch(body: BatchReportRequest, store: StoreDep) -> BatchReportResponse:
    """Apply reports in order, all in one atomic store operation (one Redis round trip).

    Each report follows the single report's rule, computed from the moment the send
    completed: `now - ageMs`. A replayed failure whose window has already ended changes
    no window. The body limit for this endpoint is 256 KiB.
    """
    reports = [
        ReportIn(r.broker_name, math.floor(r.latency_ms), r.isolation, r.age_ms)
        for r in body.reports
    ]
    return BatchReportResponse(results=[report_out(o) for o in await store.report_many(reports)])
