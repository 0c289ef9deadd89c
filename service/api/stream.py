"""GET /fault-items/stream: this replica's table as Server-Sent Events, for cached clients.

SSE rather than long-poll: one request carries every change as it happens, the
format is plain text any language can read, and proxies pass it through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from detour.model import Config, FaultItem, Route
from detour.view import ChangeKind, TableView
from service.api.deps import ERRORS, StoreDep
from service.api.push import PushResponse, StreamGate
from service.api.render import config_out, fault_event, route_out
from service.schemas import ErrorBody

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

#: Bytes of a large event (a snapshot) written at a time.
_SLICE = 16 * 1024
#: Seconds between clock events: a keep-alive and the clients' time reference.
_CLOCK_S = 1.0
_CLOCK: tuple[Literal["clock"], str, object, int] = ("clock", "", None, 0)


class _SnapshotCache:
    """The snapshot event's bulk (config, routes, items) rendered once per table change
    and shared by every connect and every resend: it was most of a connect's cost."""

    def __init__(self) -> None:
        self._tail: bytes | None = None

    def on_change(self, kind: ChangeKind, key: str, value: object, version: int) -> None:
        self._tail = None

    def event(self, view: TableView) -> Iterator[bytes | memoryview]:
        """The event in pieces: its own small head, then 16 KiB slices of the shared bulk
        (each waits for the client to take the one before: a client that stops reading
        holds at most a slice, never its own copy)."""
        tail = self._tail
        if tail is None:
            body = json.dumps(
                {
                    "config": config_out(view.config).model_dump(mode="json"),
                    "routes": [
                        route_out(view.routes[t]).model_dump(mode="json")
                        for t in sorted(view.routes)
                    ],
                    "items": [fault_event(b, i) for b, i in sorted(view.faults.items())],
                },
                separators=(",", ":"),
            )
            tail = self._tail = body[1:].encode() + b"\n\n"
        yield b'event: snapshot\ndata: {"version":%d,"now":%d,' % (view.version, view.now_ms())
        bulk = memoryview(tail)
        for start in range(0, len(bulk), _SLICE):
            yield bulk[start : start + _SLICE]


#: One cache per table; it holds nothing of the view, so the view can go.
_snapshots: weakref.WeakKeyDictionary[TableView, _SnapshotCache] = weakref.WeakKeyDictionary()


def _snapshot(view: TableView) -> Iterator[bytes | memoryview]:
    cache = _snapshots.get(view)
    if cache is None:
        cache = _snapshots[view] = _SnapshotCache()
        view.subscribe(cache.on_change)
    return cache.event(view)


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
        },
        401: ERRORS[401],
        403: ERRORS[403],
        429: {
            "model": ErrorBody,
            "description": "TOO_MANY_STREAMS: this token holds its cap of streams open on "
            "this replica already (`DETOUR_STREAM_MAX_PER_TOKEN`).",
        },
        503: {
            "model": ErrorBody,
            "description": "SYSTEM_BUSY: this replica serves its cap of streams "
            "(`DETOUR_STREAM_MAX`); see Retry-After.",
        },
    },
)
async def stream(request: Request, store: StoreDep) -> Response:
    gate: StreamGate = request.app.state.stream_gate
    principal = getattr(request.state, "principal", None)
    token = None if principal is None else principal.name
    refusal = gate.enter(token)
    if refusal is not None:
        return refusal
    try:
        view = store.view
        Change = tuple[ChangeKind | Literal["clock"], str, object, int]
        changes: asyncio.Queue[Change] = asyncio.Queue(gate.backlog)

        def on_change(kind: ChangeKind, key: str, value: object, version: int) -> None:
            try:
                changes.put_nowait((kind, key, value, version))
            except asyncio.QueueFull:
                # Too far behind: drop the backlog, the reader gets a snapshot next.
                while not changes.empty():
                    changes.get_nowait()
                changes.put_nowait(("snapshot", "", None, view.version))

        async def events() -> AsyncIterator[bytes | memoryview]:
            unsubscribe = view.subscribe(on_change)
            loop = asyncio.get_running_loop()
            clock: asyncio.TimerHandle | None = None

            def tick() -> None:
                # A timer, not a timeout around each wait: no task per event, and a
                # reader that is behind gets no clock (it will get a snapshot).
                nonlocal clock
                with contextlib.suppress(asyncio.QueueFull):
                    changes.put_nowait(_CLOCK)
                clock = loop.call_later(_CLOCK_S, tick)

            try:
                for chunk in _snapshot(view):
                    yield chunk
                # The first tick at a random phase, so streams that connected together
                # (a reconnect storm) do not all tick in the same turn of the loop.
                clock = loop.call_later(_CLOCK_S * (0.5 + random.random() / 2), tick)
                while True:
                    kind, key, value, version = await changes.get()
                    if kind == "clock":
                        yield _sse("clock", {"now": view.now_ms()})
                    elif kind == "stop":
                        return
                    elif kind == "snapshot":
                        for chunk in _snapshot(view):
                            yield chunk
                    else:
                        yield _change(view, kind, key, value, version)
            finally:
                if clock is not None:
                    clock.cancel()
                unsubscribe()

        return PushResponse(events(), gate, token)
    except BaseException:
        gate.leave(token)
        raise
