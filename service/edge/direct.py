"""`/select` and `/report-latency` answered by the server protocol, when they never wait.

A select is answered from this replica's copy of the table, and most reports are kept
on the replica (``FaultStore.report_now``): neither waits for anything. Through ASGI
each still paid for a task, uvicorn's request cycle, Starlette's request and response
objects, four middleware layers and two writes: measured, more than the select itself
(docs/BENCHMARKS.md, "Hot path"). So the protocol (service/protocol.py) hands such a
request, once its body is in, to ``DirectLane.answer``, which does what the ASGI path
does for it, with the same code, and returns the whole answer for one write:

* the shedder's rules ran when the head was read, as for every request (a head that
  had already waited past the queue-wait bound is left to the ASGI path, which refuses
  it); after that nothing queues: the answer is made in the callback that read the
  request's last bytes;
* the token check (``guard.admitted``) and the namespace's store;
* ``HotLane``'s steps: the repeated-key check, the body's validation, the endpoint's
  own function (``select.answer``, ``reports.report_in``/``applied_now``), the app's
  exception handlers for what it raises, and the request timer's metric.

Whatever it does not answer goes the ASGI way untouched, and it declines before any
side effect: a head the lane does not take (no Content-Length or over the limit, not
JSON, chunked, ``Expect``, HTTP/1.0, a pipelined request behind another, a paused
writer), a request the token check would refuse (the ASGI path answers it, with its
metrics), and a report that needs the store's I/O. Answers,
errors and metrics are the ASGI path's: ``tests/test_direct_lane.py`` checks each
against the same request sent the ASGI way, and every hot-route suite runs through it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, TypeAdapter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from service.api import reports, select
from service.api.fast import handler_for, validated, voter
from service.api.telemetry import observe_request
from service.auth import Principal, TokenTable
from service.edge.bodies import BadBody, duplicate_key, is_json
from service.edge.guard import admitted
from service.errors import error_body
from service.schemas import ReportRequest, SelectRequest
from service.store import FaultStore

log = logging.getLogger("detour.direct")

Headers = Sequence[tuple[bytes, bytes]]
#: status, headers (without the server's own), body
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
_JSON_HEADERS = (b"content-type", b"application/json")
_INTERNAL = JSONResponse(error_body("INTERNAL", "internal error"), status_code=500)


class _Declined(Exception):
    """The request goes the ASGI way (raised before any side effect)."""


def _validated(adapter: TypeAdapter[Any], body: bytes) -> Any:
    """What ``HotLane`` and ``fast.parse`` check, on bytes in hand: repeated keys, then
    the model."""
    field = duplicate_key(body) if body else None
    if field is not None:
        raise BadBody(422, f"{field}: repeated key in a JSON object", field)
    return validated(adapter, body)


def _select(store: FaultStore, model: BaseModel, principal: Principal | None) -> str:
    assert isinstance(model, SelectRequest)
    return select.answer(store, model, voter(principal, model.producer) or None)


def _report(store: FaultStore, model: BaseModel, principal: Principal | None) -> str:
    assert isinstance(model, ReportRequest)
    outcomes = reports.applied_now(store, [reports.report_in(model, principal)])
    if outcomes is None:
        raise _Declined  # the store must write it: the ASGI path awaits it
    return reports.render(outcomes[0])


#: path -> (the body's model, the endpoint's synchronous part)
_ENDPOINTS: dict[bytes, tuple[TypeAdapter[Any], Callable[..., str]]] = {
    b"/select": (select.REQUEST, _select),
    b"/report-latency": (reports.REQUEST, _report),
}


class DirectLane:
    """What the protocol asks, per hot request: ``takes`` at the head, ``answer`` at the end."""

    def __init__(
        self,
        routes: Mapping[str, Route],
        max_body_bytes: int,
        handlers: Mapping[Any, Callable[..., Any]],
        tokens: TokenTable | None = None,
    ) -> None:
        self.paths = frozenset(_ENDPOINTS)
        self.max_body_bytes = max_body_bytes
        self.tokens = tokens
        self._routes = {p.encode(): routes[p] for p in ("/select", "/report-latency")}
        self._handlers = handlers

    def takes(self, headers: Headers) -> bool:
        """Whether a POST head for one of ``paths`` is one the lane answers: a JSON body of
        a declared length within the limit (chunked, over-limit and non-JSON bodies get
        their 413/415 the ASGI way)."""
        length = -1
        json_body = False
        for name, value in headers:
            if name == b"content-length":
                if length >= 0 or not value.isdigit():
                    return False
                length = int(value)
            elif name == b"content-type":
                json_body = is_json(value)
            elif name == b"transfer-encoding":
                return False
        return json_body and 0 < length <= self.max_body_bytes

    def answer(
        self, path: bytes, headers: Headers, body: bytes, state: dict[str, Any]
    ) -> Answer | None:
        """The whole answer, or None: the request goes the ASGI way, nothing changed."""
        principal = None
        store: FaultStore = state["store"]
        if self.tokens is not None:
            principal = admitted(self.tokens, headers, "POST", path.decode())
            if principal is None:
                return None  # the guard answers 401/403
            stores = state["stores"]
            if principal.namespace in stores:
                store = stores[principal.namespace]
        adapter, endpoint = _ENDPOINTS[path]
        start = time.perf_counter()
        try:
            text = endpoint(store, _validated(adapter, body), principal)
        except _Declined:
            return None
        except Exception as exc:  # the app's handlers, as HotLane runs them
            answer = self._handled(path, headers, state, exc)
        else:
            payload = text.encode()
            answer = (200, [_JSON_HEADERS, (b"content-length", b"%d" % len(payload))], payload)
        observe_request({"route": self._routes[path], "method": "POST"}, answer[0], start)
        return answer

    def _handled(
        self, path: bytes, headers: Headers, state: dict[str, Any], exc: Exception
    ) -> Answer:
        """The app's exception handler's response for ``exc`` (the 500 one when none fits).

        The handlers are coroutines that never wait (they build a response): run to
        completion here. One that did wait would be a bug: answered as unexpected."""
        request = Request(
            {
                "type": "http",
                "method": "POST",
                "path": path.decode(),
                "raw_path": path,
                "query_string": b"",
                "root_path": "",
                "headers": list(headers),
                "state": state,
            }
        )
        handlers = self._handlers
        handler = handler_for(handlers, exc) or handlers.get(500) or handlers[Exception]
        response = _complete(handler(request, exc)) or _INTERNAL
        return int(response.status_code), list(response.raw_headers), bytes(response.body)


def _complete(coro: Any) -> Response | None:
    """Run a coroutine that does not wait; its result, or None (closed) if it waited."""
    try:
        coro.send(None)
    except StopIteration as done:
        result: Response = done.value
        return result
    coro.close()
    log.error("an exception handler waited; answered as unexpected")
    return None
