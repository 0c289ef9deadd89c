"""The bounds on streams, scrapes, batches and names, wired from Settings (docs/security.md,
"Streams, scrapes and names", "Batches"): one place, so app.py only calls it."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import FastAPI

from service.api import telemetry
from service.api.exposition import Exposition
from service.api.pacing import BatchPacer
from service.api.push import StreamGate
from service.api.table_answer import TableAnswers
from service.edge.connections import connection_bound
from service.settings import Settings
from service.store import FaultStore


def install_bounds(app: FastAPI, settings: Settings) -> None:
    """The stream caps, the /metrics cache and the batch pacer live in app state, one per
    app."""
    app.state.stream_gate = StreamGate(
        max_streams=stream_bound(settings),
        max_per_token=settings.stream_max_per_token,
        send_timeout_s=settings.stream_send_timeout_s,
        backlog=settings.stream_backlog,
    )
    app.state.batches = BatchPacer()
    app.state.table_answers = TableAnswers()
    app.state.exposition = Exposition(settings.metrics_cache_s, settings.metrics_max_brokers)
    telemetry.set_broker_series_cap(settings.metrics_max_brokers)


def stream_bound(settings: Settings) -> int:
    """Push streams this process serves at once: ``DETOUR_STREAM_MAX``, and never more than
    half its connections. A stream is never idle (the edge cannot close it to make room)
    and a client that reads nothing of its few bytes a second fills no buffer for hours,
    so streams alone could otherwise take every connection and lock every producer out."""
    return max(1, min(settings.stream_max, connection_bound(settings.max_connections) // 2))


def bound_names(stores: Iterable[FaultStore], settings: Settings) -> None:
    """Each table's selector state: topic counters and latency scores kept at most."""
    for store in stores:
        store.view.bound_names(settings.max_topic_counters, settings.max_brokers)
