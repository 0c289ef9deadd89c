"""GET /fault-items/stream: this replica's table as Server-Sent Events, for cached clients.

SSE rather than long-poll: one request carries every change as it happens, the
format is plain text any language can read, and proxies pass it through.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from service.api.deps import StoreDep
from service.api.render import config_out, fault_event, route_out
from service.model import Config, FaultItem, Route
from service.view import ChangeKind, TableView

SSE_EVENT: dict[str, object] = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "description": "`snapshot`, then one per change."},
        "data": {"type": "string", "description": "The event's JSON document."},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}

router = APIRouter(tags=["admin"])

#: Changes a slow reader may fall behind by before it gets a fresh snapshot instead.
_BACKLOG = 4096
#: Seconds between clock events: a keep-alive and the clients' time reference.
_CLOCK_S = 1.0

_DESCRIPTION = """\
Events, each `event: <kind>` then `data: <JSON>`; every JSON carries `now` (the store's
epoch ms when it was sent):

* `snapshot` `{"version", "now", "config", "routes": [Route], "items": [{"brokerName",
  "currentLatencyMs", "availableAt"}]}` first, and again whenever the replica resynced or
  the reader fell behind: replace everything.
* `fault` `{"brokerName", "currentLatencyMs", "availableAt", "version", "now"}` or
  `{"brokerName", "deleted": true, "version", "now"}`: a window opened, moved or cleared.
* `route` a Route plus `version` and `now`, or `{"topic", "deleted": true, "version", "now"}`.
* `config` the Config plus `version` and `now`.
* `clock` `{"now"}` every second.

`version` is the store version of the change (0 for a window a replica set on its own
while Redis was unreachable). The stream ends when the replica stops; reconnect.
"""


def _sse(kind: str, data: dict[str, object]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _snapshot(view: TableView) -> bytes:
    return _sse(
        "snapshot",
        {
            "version": view.version,
            "now": view.now_ms(),
            "config": config_out(view.config).model_dump(mode="json"),
            "routes": [
                route_out(view.routes[t]).model_dump(mode="json") for t in sorted(view.routes)
            ],
            "items": [fault_event(b, i) for b, i in sorted(view.faults.items())],
        },
    )


def _change(view: TableView, kind: ChangeKind, key: str, value: object, version: int) -> bytes:
    meta = {"version": version, "now": view.now_ms()}
    if kind == "fault":
        assert value is None or isinstance(value, FaultItem)
        return _sse("fault", {**fault_event(key, value), **meta})
    if kind == "route":
        if value is None:
            return _sse("route", {"topic": key, "deleted": True, **meta})
        assert isinstance(value, Route)
        return _sse("route", {**route_out(value).model_dump(mode="json"), **meta})
    assert isinstance(value, Config)
    return _sse("config", {**config_out(value).model_dump(mode="json"), **meta})


@router.get(
    "/fault-items/stream",
    response_class=StreamingResponse,
    summary="Follow the table as Server-Sent Events",
    description=_DESCRIPTION,
    responses={
        200: {
            "description": "An endless `text/event-stream`.",
            # Each event, as SSE parsers read it (``event``, and ``data``: a JSON text).
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
        }
    },
)
async def stream(store: StoreDep) -> StreamingResponse:
    view = store.view
    Change = tuple[ChangeKind, str, object, int]
    changes: asyncio.Queue[Change] = asyncio.Queue(_BACKLOG)

    def on_change(kind: ChangeKind, key: str, value: object, version: int) -> None:
        try:
            changes.put_nowait((kind, key, value, version))
        except asyncio.QueueFull:
            # Too far behind: drop the backlog, the reader gets a snapshot next.
            while not changes.empty():
                changes.get_nowait()
            changes.put_nowait(("snapshot", "", None, view.version))

    async def events() -> AsyncIterator[bytes]:
        unsubscribe = view.subscribe(on_change)
        try:
            yield _snapshot(view)
            loop = asyncio.get_running_loop()
            next_clock = loop.time() + _CLOCK_S
            while True:
                try:
                    kind, key, value, version = await asyncio.wait_for(
                        changes.get(), max(0.0, next_clock - loop.time())
                    )
                except TimeoutError:
                    yield _sse("clock", {"now": view.now_ms()})
                    next_clock = loop.time() + _CLOCK_S
                    continue
                if kind == "stop":
                    return
                if kind == "snapshot":
                    yield _snapshot(view)
                else:
                    yield _change(view, kind, key, value, version)
        finally:
            unsubscribe()

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
