"""CPU per hot request inside the app, with and without the hot lane (service/api/fast.py).

``python -m bench.lane [--calls N] [--rounds R]``: the whole ASGI app (memory store), called
directly in this process without a server or a socket, so the machine's other load
counts much less than in a wrk run: the figure is the thread's CPU time per request,
the two variants alternating round by round, medians of the rounds. Without the lane
means the app as built, with ``HotLane`` removed from its middleware (the chain of
body limit, timer, JSON check, exception middleware, router it replaces).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from starlette.types import Message

from service.api.fast import HotLane
from service.app import create_app
from service.settings import Settings

ROUTE = {"brokers": [{"brokerName": f"broker-{c}", "writeQueueNums": 4} for c in "ab"]}
CALLS = (
    ("select", "/select", b'{"topic":"orders"}'),
    ("report", "/report-latency", b'{"brokerName":"broker-a","latencyMs":7}'),
)


async def _run(lane: bool, calls: int) -> dict[str, float]:
    """µs of CPU per request, by endpoint, for one fresh app."""
    app = create_app(Settings())
    if not lane:
        app.user_middleware = [
            m
            for m in app.user_middleware
            if m.cls is not HotLane  # type: ignore[comparison-overlap]
        ]
    async with app.router.lifespan_context(app) as state:

        async def call(method: str, path: str, body: bytes) -> int:
            scope: dict[str, Any] = {
                "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                "method": method, "path": path, "raw_path": path.encode(), "root_path": "",
                "scheme": "http", "query_string": b"", "server": ("127.0.0.1", 80),
                "client": ("127.0.0.1", 1), "state": dict(state or {}),
                "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())],
            }  # fmt: skip
            messages: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
            out: list[Message] = []

            async def receive() -> Message:
                return messages.pop() if messages else {"type": "http.disconnect"}

            async def send(message: Message) -> None:
                out.append(message)

            await app(scope, receive, send)
            return int(out[0]["status"])

        assert await call("PUT", "/routes/orders", json.dumps(ROUTE).encode()) == 200
        result = {}
        for name, path, body in CALLS:
            for _ in range(500):  # warm-up
                assert await call("POST", path, body) == 200
            t0 = time.thread_time_ns()
            for _ in range(calls):
                await call("POST", path, body)
            result[name] = (time.thread_time_ns() - t0) / calls / 1000
        return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lane", description=__doc__)
    p.add_argument("--calls", type=int, default=3000, help="requests per endpoint and round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"lane": [], "chain": []}
    for r in range(args.rounds):
        for lane in (True, False) if r % 2 == 0 else (False, True):
            runs["lane" if lane else "chain"].append(asyncio.run(_run(lane, args.calls)))
    print("| app | /select CPU µs/request (rounds) | median | /report-latency (rounds) | median |")
    print("|---|---|---:|---|---:|")
    for label, key in (("without the lane (middleware chain)", "chain"), ("with HotLane", "lane")):
        rows = runs[key]
        cells = []
        for name, _, _ in CALLS:
            values = [x[name] for x in rows]
            cells += [", ".join(f"{v:.1f}" for v in values), f"**{statistics.median(values):.1f}**"]
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
