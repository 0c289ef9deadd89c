"""The floor: Detour's HTTP stack with nothing behind it, to measure what the stack itself costs.

Same framework (FastAPI), same server (uvicorn with uvloop/httptools picked
automatically, no access log, no proxy headers, no server header, the same worker
count), same paths and similar response bodies as Detour, but each handler
returns a constant precomputed JSON body and never reads or parses the request.
Whatever Detour's /select is slower than this, Detour's own code costs: body
validation, the strategy, response serialisation, its middleware.

Beside it the raw-ASGI floor (``create_raw_app``): the same server and bodies with no
framework at all, what uvicorn alone costs; the hot-path targets are ratios to it.

Run them the way the benchmark does::

    .venv/bin/python -m uvicorn bench.floor:create_app --factory --port 8090 --no-access-log
    .venv/bin/python -m uvicorn bench.floor:create_raw_app --factory --port 8091 --no-access-log
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastapi import FastAPI, Response
from starlette.types import ASGIApp, Receive, Scope, Send

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


def create_raw_app() -> ASGIApp:
    """The raw-ASGI floor: one coroutine, no framework, the same constant bodies.

    What uvicorn (its httptools protocol and the ASGI cycle) costs alone; the issue's
    hot-path targets are ratios to this. It does not read the request body either.
    """
    bodies = {
        "/select": _encode(SELECT_ANSWER),
        "/report-latency": _encode(REPORT_ANSWER),
        "/readyz": _encode({"status": "ready", "store": "none"}),
    }
    heads = {
        path: {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
        for path, body in bodies.items()
    }
    messages = {path: {"type": "http.response.body", "body": body} for path, body in bodies.items()}
    missing = {"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]}
    empty = {"type": "http.response.body", "body": b""}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        head = heads.get(path)
        if head is None:
            await send(missing)
            await send(empty)
            return
        await send(head)
        await send(messages[path])

    return app


class FloorServer(HttpProcess):
    """``uvicorn bench.floor:create_app --factory`` as its own process group, on a free port.

    The options mirror ``service/__main__.py``'s ``uvicorn.run`` call; loop and
    http stay at uvicorn's ``auto`` (uvloop and httptools when installed), as there.
    Its ``timeout_graceful_shutdown`` only matters when stopping and is left out.
    """

    def __init__(self, workers: int = 1, log_path: Path | None = None, raw: bool = False) -> None:
        port = free_port()
        factory = "bench.floor:create_raw_app" if raw else "bench.floor:create_app"
        args = [
            sys.executable, "-m", "uvicorn", factory, "--factory",
            "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
            "--log-level", "warning", "--no-access-log", "--no-proxy-headers",
            "--no-server-header",
        ]  # fmt: skip
        super().__init__("raw-floor" if raw else "floor", args, port, None, log_path)
