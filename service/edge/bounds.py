"""The bounds on streams, scrapes, batches and names, wired from Settings (docs/security.md,
"Streams, scrapes and names", "Batches"): one place, so app.py only calls it."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import FastAPI

from service.api import telemetry
from service.api.exposition import Exposition
from service.api.pacing import BatchPacer
from service.api.push import StreamGate
from service.settings import Settings
from service.store import FaultStore


def install_bounds(app: FastAPI, settings: Settings) -> None:
    """The stream caps, the /metrics cache and the batch pacer live in app state, one per
    app."""
    app.state.stream_gate = StreamGate(
        max_streams=settings.stream_max,
        max_per_token=settings.stream_max_per_token,
        send_timeout_s=settings.stream_send_timeout_s,
        backlog=settings.stream_backlog,
    )
    app.state.batches = BatchPacer()
    app.state.exposition = Exposition(settings.metrics_cache_s, settings.metrics_max_brokers)
    telemetry.set_broker_series_cap(settings.metrics_max_brokers)


def bound_names(stores: Iterable[FaultStore], settings: Settings) -> None:
    """Each table's selector state: topic counters and latency scores kept at most."""
    for store in stores:
        store.view.bound_names(settings.max_topic_counters, settings.max_brokers)
