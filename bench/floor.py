"""The floor: Detour's HTTP stack with nothing behind it, to measure what the stack itself costs.

Same framework (FastAPI), same server (uvicorn with uvloop/httptools picked
automatically, no access log, no proxy headers, no server header, the same worker
count), same paths and similar response bodies as Detour, but each handler
returns a constant precomputed JSON body and never reads or parses the request.
Whatever Detour's /select is slower than this, Detour's own code costs: body
validation, the strategy, response serialisation, its middleware.

Run it the way the benchmark does::

    .venv/bin/python -m uvicorn bench.floor:create_app --factory --port 8090 --no-access-log
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastapi import FastAPI, Response

from tests.procs import HttpProcess, free_port

#: What Detour answers a select on the benchmark route with (same fields, same size).
SELECT_ANSWER: dict[str, object] = {
    "topic": "orders",
    "brokerName": "broker-a",
    "queueId": 0,
    "address": None,
    "decision": "available",
    "avoidedBrokers": [],
}
#: What Detour answers a report below 550 ms with.
REPORT_ANSWER: dict[str, object] = {
    "brokerName": "broker-a",
    "latencyMs": 120,
    "notAvailableDurationMs": 0,
    "availableAt": 1763791234567,
}


def _encode(body: dict[str, object]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def create_app() -> FastAPI:
    """The floor app; bodies are encoded once here, never per request."""
    select_body = _encode(SELECT_ANSWER)
    report_body = _encode(REPORT_ANSWER)
    ready_body = _encode({"status": "ready", "store": "none"})

    app = FastAPI(title="Detour floor", openapi_url=None, docs_url=None, redoc_url=None)

    # No body parameter: FastAPI neither reads nor validates the request body.
    @app.post("/select")
    async def select() -> Response:
        return Response(content=select_body, media_type="application/json")

    @app.post("/report-latency")
    async def report_latency() -> Response:
        return Response(content=report_body, media_type="application/json")

    @app.get("/readyz")
    async def readyz() -> Response:
        return Response(content=ready_body, media_type="application/json")

    return app


class FloorServer(HttpProcess):
    """``uvicorn bench.floor:create_app --factory`` as its own process group, on a free port.

    The options mirror ``service/__main__.py``'s ``uvicorn.run`` call; loop and
    http stay at uvicorn's ``auto`` (uvloop and httptools when installed), as there.
    Its ``timeout_graceful_shutdown`` only matters when stopping and is left out.
    """

    def __init__(self, workers: int = 1, log_path: Path | None = None) -> None:
        port = free_port()
        args = [
            sys.executable, "-m", "uvicorn", "bench.floor:create_app", "--factory",
            "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
            "--log-level", "warning", "--no-access-log", "--no-proxy-headers",
            "--no-server-header",
        ]  # fmt: skip
        super().__init__("floor", args, port, None, log_path)
