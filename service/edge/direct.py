"""`/select` and `/report-latency` answered by the server protocol, when they never wait.

Detour has two ways in: its FastAPI routes, for every request, and this lane, for the two
calls every producer makes per send. A select is answered from this replica's copy of the
table, and most reports are kept on the replica (``FaultStore.report_now``): neither waits
for anything. Through ASGI each still paid for a task, uvicorn's request cycle,
Starlette's request and response objects, the middleware layers and two writes:
measured, more than the select itself (docs/BENCHMARKS.md, "Hot path"). So the protocol
(service/edge/protocol.py) hands such a request, once its body is in, to
``DirectLane.answer``, which does what the ASGI way does for it and returns the whole
answer for one write:

* the shedder's rules ran when the head was read, as for every request (a head that
  had already waited past the queue-wait bound is left to the ASGI way, which refuses
  it); after that nothing queues: the answer is made in the callback that read the
  request's last bytes;
* the token check (``guard.admitted``) and the namespace's store;
* the middleware's and the route's steps, with the same code where the code is
  Detour's: the repeated-key check (``bodies.check_keys``); the body decoded and
  validated as FastAPI does for a declared JSON body (``decoded``: ``json.loads``,
  then the model, errors under ``body``); the endpoint's own synchronous part
  (``select.answer``, ``reports.report_in``/``applied_now``/``render``); the app's
  exception handlers for what it raises (``handlers``); the request timer's metric.

Whatever it does not answer goes the ASGI way untouched, and it declines before any side
effect: a head the lane does not take (no Content-Length or over the limit, not JSON,
chunked, ``Expect``, HTTP/1.0, a pipelined request behind another, a paused writer), a
request the token check would refuse (the ASGI way answers it, with its metrics), and a
report that needs the store's I/O. Answers, errors and metrics are the ASGI way's:
``tests/test_direct_lane.py`` checks each against the same request sent the ASGI way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request

from service.api import reports, select
from service.api.caller import voter
from service.api.telemetry import observe_request
from service.auth import Principal, TokenTable
from service.edge import answers
from service.edge.bodies import check_keys, is_json, one_type
from service.edge.guard import admitted
from service.edge.handlers import Handlers, handler_for, run_handler
from service.schemas import ReportRequest, SelectRequest
from service.store import FaultStore

Headers = Sequence[tuple[bytes, bytes]]
#: status, headers (without the server's own), body
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
_INTERNAL = (
    500,
    answers.error_headers(answers.error_json("INTERNAL", "internal error")),
    answers.error_json("INTERNAL", "internal error"),
)


class _Declined(Exception):
    """The request goes the ASGI way (raised before any side effect)."""


def decoded(adapter: TypeAdapter[Any], body: bytes) -> Any:
    """``body`` as FastAPI turns a declared JSON body into its model (fastapi.routing's
    request handler, then the field's validation): ``json.loads``; a JSONDecodeError is a
    ``json_invalid`` validation error, anything else it raises a 400; then the model, its
    errors located under ``body``. The same steps give the same answers.

    A valid body takes the short way, pydantic's own JSON parser (a fraction of the two
    steps' cost, docs/BENCHMARKS.md "Hot path"): a body it accepts is one the two steps accept,
    with the same model. Only a body it refuses goes the two steps, so that the error is
    FastAPI's, word for word."""
    try:
        return adapter.validate_json(body)
    except ValidationError:
        pass
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", exc.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": exc.msg},
                }
            ]
        ) from None
    except Exception:  # noqa: BLE001 - what FastAPI answers 400 for (nesting, huge numbers)
        raise HTTPException(400, "There was an error parsing the body") from None
    try:
        return adapter.validate_python(value, from_attributes=True)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        ) from None


def _select(store: FaultStore, model: BaseModel, principal: Principal | None) -> str:
    assert isinstance(model, SelectRequest)
    return select.answer(store, model, voter(principal, model.producer) or None)


def _report(store: FaultStore, model: BaseModel, principal: Principal | None) -> str:
    assert isinstance(model, ReportRequest)
    outcomes = reports.applied_now(store, [reports.report_in(model, principal)])
    if outcomes is None:
        raise _Declined  # the store must write it: the ASGI way awaits it
    return reports.render(outcomes[0])


#: path -> (the body's model, the endpoint's synchronous part)
_ENDPOINTS: dict[bytes, tuple[TypeAdapter[Any], Callable[..., str]]] = {
    b"/select": (TypeAdapter(SelectRequest), _select),
    b"/report-latency": (TypeAdapter(ReportRequest), _report),
}
#: The lane's paths.
PATHS = frozenset(p.decode() for p in _ENDPOINTS)


class DirectLane:
    """What the protocol asks, per hot request: ``takes`` at the head, ``answer`` at the end."""

    def __init__(
        self,
        routes: Mapping[str, Any],
        max_body_bytes: int,
        handlers: Handlers,
        tokens: TokenTable | None = None,
    ) -> None:
        """``routes``: the app's route for each of ``PATHS`` (the request timer labels by
        its template); ``handlers``: the app's exception handlers."""
        self.paths = frozenset(_ENDPOINTS)
        self.max_body_bytes = max_body_bytes
        self.tokens = tokens
        self._routes = {p.encode(): routes[p] for p in PATHS}
        self._handlers = handlers

    def takes(self, headers: Headers) -> bool:
        """Whether a POST head for one of ``paths`` is one the lane answers: a JSON body of
        a declared length within the limit (chunked, over-limit and non-JSON bodies get
        their 413/415 the ASGI way)."""
        length = -1
        content_type = None
        for name, value in headers:
            if name == b"content-length":
                if length >= 0 or not value.isdigit():
                    return False
                length = int(value)
            elif name == b"content-type":
                content_type = one_type(content_type, value)
            elif name == b"transfer-encoding":
                return False
        return is_json(content_type) and 0 < length <= self.max_body_bytes

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
            check_keys(body)
            text = endpoint(store, decoded(adapter, body), principal)
        except _Declined:
            return None
        except Exception as exc:  # the app's handlers, as the ASGI way runs them
            answer = self._handled(path, headers, state, exc)
        else:
            payload = text.encode()
            answer = (
                200,
                [answers.JSON_TYPE, (b"content-length", b"%d" % len(payload))],
                payload,
            )
        observe_request({"route": self._routes[path], "method": "POST"}, answer[0], start)
        return answer

    def _handled(
        self, path: bytes, headers: Headers, state: dict[str, Any], exc: Exception
    ) -> Answer:
        """The app's exception handler's response for ``exc``."""
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
        response = run_handler(handler_for(self._handlers, exc), request, exc)
        if response is None:
            return _INTERNAL
        return int(response.status_code), list(response.raw_headers), bytes(response.body)
