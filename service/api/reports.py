"""POST /report-latency and its batch form: producers tell how sends went."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from service import metrics
from service.api.caller import principal_of, reporter, voter
from service.api.deps import ERRORS, STREAM_ID_PATTERN, UNAVAILABLE, StoreDep
from service.api.pacing import BatchPacer
from service.api.telemetry import observe_reports
from service.auth import Principal
from service.errors import ReportIdReused, TableFull
from service.schemas import (
    BatchReport,
    BatchReportRequest,
    BatchReportResponse,
    ErrorBody,
    LatencyLogOut,
    LogEntryOut,
    ReportRequest,
    ReportResponse,
)
from service.store import FaultStore, ReportIn, ReportOutcome
from service.store.ids import ReportIds

#: Reports of a batch applied as one store operation; other requests go between chunks
#: (``BatchPacer``). A report that moves a window costs Redis its script and the replica
#: the push it comes back as: a chunk holds either for a few ms (docs/BENCHMARKS.md,
#: "Redis load per report"), not for a whole batch's tens or hundreds.
BATCH_CHUNK = 25
#: Reports of a batch validated between two turns of the event loop: a turn stays short.
VALIDATE_CHUNK = 100
_ITEM = TypeAdapter(BatchReport)

router = APIRouter(tags=["reports"])
_TABLE_FULL: dict[int | str, dict[str, Any]] = {
    409: {
        "model": ErrorBody,
        "description": "TABLE_FULL: a report names a new broker and the namespace's table "
        "holds `DETOUR_MAX_BROKERS` open windows. Nothing of a single report changed; of a "
        f"batch, the chunks of {BATCH_CHUNK} before the refused report's were applied.",
    },
    422: {
        "model": ErrorBody,
        "description": "VALIDATION_ERROR: a field failed validation, or a JSON object repeats a "
        "key; `field` names it. REPORT_ID_REUSED: a `reportId` its scope (the token, or the "
        "open deployment) used in the last 15 minutes for a report with other content, or "
        "twice with different content in one batch; `field` names it. Nothing of a single "
        "report changed; of a batch, nothing when the id is repeated within it, else the "
        f"chunks of {BATCH_CHUNK} before the refused report's were applied.",
    },
}


@contextmanager
def _counting_table_full(store: FaultStore, reports: list[ReportIn]) -> Iterator[None]:
    try:
        yield
    except TableFull:
        metrics.REPORTS_REFUSED.labels(store.namespace, "table_full").inc(len(reports))
        raise


async def _apply(store: FaultStore, reports: list[ReportIn]) -> list[ReportOutcome]:
    """Applied at once when the store needs no I/O for them, else one store operation."""
    outcomes = applied_now(store, reports)
    if outcomes is None:
        with _counting_table_full(store, reports):
            outcomes = await store.report_many(reports)
        observe_reports(store.namespace, outcomes)
    return outcomes


@router.post(
    "/report-latency",
    response_model=ReportResponse,
    responses={**ERRORS, **_TABLE_FULL, **UNAVAILABLE},
    summary="Report a send's latency or failure",
)
async def report_latency(body: ReportRequest, store: StoreDep, request: Request) -> Response:
    """Record a send's latency, or its failure (`isolation: true`), for a broker.

    Duration: scan `latencyMax` from the top; the first `i` with
    `latency >= latencyMax[i]` gives `notAvailableDuration[i]`, else 0. A failure counts
    as `isolationLatencyMs` (default 30000 ms, so 600 s). The update, atomic on the
    store's clock `now`: `currentLatencyMs := latencyMs`; the window end becomes
    `max(old end, now + duration)`, or `now + duration` with `lastReportWins`. With
    avoidance off the report is accepted and changes nothing. One store round trip.

    `pending: true`: an in-flight signal, the send is still outstanding (`pendingQuorum`,
    docs/policy.md "Hangs"); the producer's next report that is not pending withdraws it.
    """
    reports = [report_in(body, principal_of(request.scope["state"]))]
    outcomes = await _apply(store, reports)
    return Response(render(outcomes[0]), media_type="application/json")


def report_in(body: ReportRequest, principal: Principal | None) -> ReportIn:
    """The one place a request's report becomes the core's ``ReportIn`` (single reports,
    batch items, the direct lane): who reported, who votes, whose report id it is."""
    return ReportIn(
        body.broker_name,
        math.floor(body.latency_ms),
        body.isolation,
        body.age_ms if isinstance(body, BatchReport) else 0,
        reporter(principal, body.producer),
        body.origin,
        voter(principal, body.producer),
        report_id=body.report_id or "",
        pending=body.pending,
        scope=principal.name if principal is not None else "",
    )


def applied_now(store: FaultStore, reports: list[ReportIn]) -> list[ReportOutcome] | None:
    """The outcomes when the store applies the reports without waiting (``report_now``);
    None: the caller awaits ``_apply``."""
    with _counting_table_full(store, reports):
        outcomes = store.report_now(reports)
    if outcomes is not None:
        observe_reports(store.namespace, outcomes)
    return outcomes


def render(o: ReportOutcome) -> str:
    # brokerName matched NAME_PATTERN on the way in: nothing to escape.
    return (
        f'{{"brokerName":"{o.broker_name}","latencyMs":{o.latency_ms},'
        f'"notAvailableDurationMs":{o.not_available_duration_ms},'
        f'"availableAt":{o.available_at},"degraded":{"true" if o.degraded else "false"},'
        f'"duplicate":{"true" if o.duplicate else "false"},'
        f'"expired":{"true" if o.expired else "false"}}}'
    )


@router.post(
    "/report-latency:batch",
    response_model=BatchReportResponse,
    responses={**ERRORS, **_TABLE_FULL, **UNAVAILABLE},
    summary="Report up to 1,000 sends at once",
)
async def report_latency_batch(
    body: BatchReportRequest, store: StoreDep, request: Request
) -> Response:
    """Validate every report, then apply them in order, in chunks of 25, each chunk one
    atomic store operation (one Redis round trip). A batch costs its sender, not the
    other producers (docs/security.md, "Batches"): a namespace's batches run one at a
    time, and between two chunks a batch pauses as long as the chunk took, leaving the
    replica and Redis to other requests. A report carrying `reportId` is applied once,
    however often its batch is sent.

    Each report follows the single report's rule, computed from the moment the send
    completed: `now - ageMs`. A replayed failure whose window has already ended changes
    no window. The body limit for this endpoint is 256 KiB.
    """
    reports = await _validated(body.reports, principal_of(request.scope["state"]))
    # An id repeated with other content within the batch is refused before any chunk is
    # applied (the same rule the stores apply to one call).
    with _naming_item(0):
        ReportIds().check(reports, 0)
    parts: list[str] = []
    pacer: BatchPacer = request.app.state.batches
    async with pacer.turn(store.namespace) as pace:
        for start in range(0, len(reports), BATCH_CHUNK):
            if start:
                await pace.between_chunks()  # other requests go first
            chunk = reports[start : start + BATCH_CHUNK]
            with _naming_item(start):
                parts.extend(render(o) for o in await _apply(store, chunk))
    return Response('{"results":[' + ",".join(parts) + "]}", media_type="application/json")


@contextmanager
def _naming_item(offset: int) -> Iterator[None]:
    """Names the batch item a refused report id is on (a store counts within its chunk)."""
    try:
        yield
    except ReportIdReused as exc:
        exc.index += offset
        exc.field = f"reports[{exc.index}].reportId"
        if offset:
            # Chunks before this one were applied: the answer says so, and how to finish.
            exc.message += (
                f"; reports[0] to reports[{offset - 1}] were applied (a batch is applied "
                f"{BATCH_CHUNK} at a time): sent again with their ids, they are answered "
                "as duplicates"
            )
        raise


async def _validated(raw: list[dict[str, Any]], principal: Principal | None) -> list[ReportIn]:
    """The batch's reports, each validated as a ``BatchReport`` and made the core's
    ``ReportIn``, all before any is applied (an invalid one is a 422 naming it, and nothing
    changed), ``VALIDATE_CHUNK`` at a time with a turn of the event loop between them: a
    1,000-report batch is about 10 ms of CPU here, which in one turn every other request
    would wait behind."""
    reports: list[ReportIn] = []
    for start in range(0, len(raw), VALIDATE_CHUNK):
        if start:
            await asyncio.sleep(0)
        for i, item in enumerate(raw[start : start + VALIDATE_CHUNK], start):
            try:
                reports.append(report_in(_ITEM.validate_python(item), principal))
            except ValidationError as exc:
                raise RequestValidationError(
                    [{**e, "loc": ("body", "reports", i, *e["loc"])} for e in exc.errors()]
                ) from None
    return reports


@router.get(
    "/latency-log",
    response_model=LatencyLogOut,
    responses={**ERRORS, **UNAVAILABLE},
    summary="Read the latency log: significant reports and histograms, oldest first",
)
async def latency_log(
    store: StoreDep,
    after: Annotated[
        str | None,
        Query(
            pattern=STREAM_ID_PATTERN,
            description="Read entries after this id.",
            examples=["1763791234567-0"],
        ),
    ] = None,
    limit: Annotated[
        int, Query(ge=1, le=10000, description="Most entries to return.", examples=[1000])
    ] = 1000,
) -> JSONResponse:
    """Page through the latency log (bounded: `DETOUR_LATENCY_LOG_MAX` entries, default
    100,000). `pipeline/export_log.py` turns it into Parquet for the analysis job."""
    entries = await store.latency_log(after, limit)
    out = LatencyLogOut(
        entries=[
            LogEntryOut(
                id=e.id,
                broker_name=e.broker_name,
                latency_ms=e.latency_ms,
                isolation=e.isolation,
                producer=e.producer,
                at=e.at,
                histogram=None if e.histogram is None else list(e.histogram),
                since=e.since,
            )
            for e in entries
        ],
        next=entries[-1].id if entries else None,
    ).model_dump(mode="json")
    # An entry for one report keeps its shape: the histogram fields only where they are set.
    for entry in out["entries"]:
        if entry["histogram"] is None:
            del entry["histogram"], entry["since"]
    return JSONResponse(out)
