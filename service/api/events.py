"""GET /events: the event log, every window opened, extended, ended early or reached by quorum."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service.api.deps import ERRORS, STREAM_ID_PATTERN, UNAVAILABLE, StoreDep
from service.schemas import EventOut, EventsOut

router = APIRouter(tags=["admin"])


@router.get(
    "/events",
    response_model=EventsOut,
    responses={**ERRORS, **UNAVAILABLE},
    summary="Read the event log: avoidance windows opened, extended and ended, oldest first",
)
async def events(
    store: StoreDep,
    since: Annotated[
        str | None,
        Query(
            pattern=STREAM_ID_PATTERN,
            description="Read events after this id.",
            examples=["1763791234567-0"],
        ),
    ] = None,
    limit: Annotated[
        int, Query(ge=1, le=1000, description="Most events to return.", examples=[100])
    ] = 100,
    latest: Annotated[
        bool,
        Query(
            description="The newest `limit` events instead (`since` is then ignored).",
            examples=[False],
        ),
    ] = False,
) -> EventsOut:
    """Bounded (`DETOUR_EVENTS_MAX` events, default 10,000, the oldest trimmed), like
    Envoy's outlier event log: what the policy did and why (docs/policy.md). Pages
    oldest first from `since`; `latest=true` gives the newest `limit` (the status page)."""
    entries = await store.events(since, limit, latest)
    return EventsOut(
        events=[
            EventOut(
                id=e.id,
                kind=e.kind,  # type: ignore[arg-type]
                reason=e.reason,  # type: ignore[arg-type]
                broker_name=e.broker_name,
                tier_ms=e.tier_ms,
                reporters=e.reporters,
                available_at=e.available_at,
                at=e.at,
            )
            for e in entries
        ],
        next=entries[-1].id if entries else None,
    )
