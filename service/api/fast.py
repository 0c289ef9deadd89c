"""The two calls every producer makes per send, served without FastAPI's per-request work.

`POST /select` and `POST /report-latency` are declared on FastAPI routers like every
other endpoint (that is what builds openapi.yaml), and the same endpoint functions
are also mounted as plain Starlette routes ahead of them, so requests skip dependency
solving, telemetry checks and response validation. The body is validated by
pydantic-core straight from bytes; the answer is written directly. Both stay inside
the app's middleware and exception handlers, so limits, metrics and the Error
schema are the same as everywhere else. docs/BENCHMARKS.md has the measurements.

``HotLane`` goes one step further for these two: one middleware that does, in one
pass, what the body limit, the request timer, the JSON check, the exception
middleware, the router and Starlette's request wrapper do in six, in the same order
and with the same answers, metrics and handlers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.telemetry import observe_request
from service.auth import Principal
from service.edge.bodies import BadBody, BodyLimit, JsonBodies, duplicate_key, has_body, is_json
from service.store import FaultStore

M = TypeVar("M", bound=BaseModel)
Endpoint = Callable[[Request], Any]


async def parse(request: Request, adapter: TypeAdapter[M]) -> M:
    """The request body as a model; errors are reported as FastAPI's would be (under `body`)."""
    return validated(adapter, await request.body())


def validated(adapter: TypeAdapter[M], body: bytes) -> M:
    """``parse`` on bytes in hand (the direct lane has the body already)."""
    try:
        return adapter.validate_json(body or b"null")
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        ) from None


def store_of(request: Request) -> FaultStore:
    # The scope's state dict, not ``request.state``: that builds a wrapper per access.
    store: FaultStore = request.scope["state"]["store"]
    return store


def reporter_of(request: Request, given: str | None) -> str:
    """Who made a report: with tokens, the token's name, then ``/`` and the producer id
    the request gave, so one token's holder cannot report as another's producers."""
    return reporter(request.scope["state"].get("principal"), given)


def reporter(principal: Principal | None, given: str | None) -> str:
    if principal is None:
        return given or ""
    return f"{principal.name}/{given}" if given else principal.name


def voter_of(request: Request, given: str | None) -> str:
    """Who the isolation quorum counts a producer as: with tokens, the token's name alone
    (a holder cannot vote as many producers by varying ``producer``); else the id given."""
    return voter(request.scope["state"].get("principal"), given)


def voter(principal: Principal | None, given: str | None) -> str:
    return principal.name if principal is not None else given or ""


def json_response(body: str) -> Response:
    return Response(body, media_type="application/json")


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` declaring a JSON body of ``model`` for a route that reads raw bytes."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


class _FastRoute(Route):
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        # FastAPI's router records only its own routes in the scope; the request
        # timer labels by scope["route"].
        scope["route"] = self
        await super().handle(scope, receive, send)


def mount_fast(app: FastAPI, routes: Iterable[tuple[str, Endpoint]]) -> dict[str, Route]:
    """Put plain routes for these POST paths in front of the FastAPI-declared ones;
    returns them by path (for ``HotLane``)."""
    mounted: dict[str, Route] = {}
    for path, endpoint in routes:
        route = mounted[path] = _FastRoute(path, endpoint, methods=["POST"])
        app.router.routes.insert(0, route)
    return mounted


class HotLane:
    """POST to the hot routes, served in one pass; every other request passes on.

    It stands where ``BodyLimit`` stood (inside the token guard) and does, in order,
    what the chain below it did: 413 when Content-Length is over the limit (not timed,
    as before the timer); then, timed: 415 for a body that is not JSON (timed as
    ``unmatched``, as the JSON check ran before the router); the route; the endpoint,
    whose body reads count toward the limit and are checked for repeated keys; and
    the app's exception handlers for anything it raises (an exception without one, or
    the 500 handler's, goes on to the server-error middleware as before). Each step
    is the same code as the middleware's (``BodyLimit``, ``JsonBodies``, the timer's
    ``observe_request``), so the answers, metrics and errors are the same; what goes
    is five coroutine layers, three ``receive``/``send`` wrappers and the router's
    walk per request.
    """

    def __init__(
        self,
        app: ASGIApp,
        routes: Mapping[str, Route],
        max_bytes: int,
        handlers: Mapping[Any, Callable[..., Any]],
    ) -> None:
        self.app = app
        self.routes = dict(routes)
        self.limit = BodyLimit(app, max_bytes)
        self.json = JsonBodies(app)
        #: The app's handlers, read when a request needs one (as the exception
        #: middleware splits them: status codes apart; 500 and Exception are the
        #: server-error middleware's).
        self._handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        limit = self.limit.max_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_large = int(value) > limit
                except ValueError:
                    too_large = False
                if too_large:
                    await self.limit.reject(send, limit)
                    return
                break
        start = time.perf_counter()
        status = 500
        try:
            status = await self._serve(route, scope, receive, send, limit)
        finally:
            observe_request(scope, status, start)

    async def _serve(
        self, route: Route, scope: Scope, receive: Receive, send: Send, limit: int
    ) -> int:
        """Answer the request; returns the status it was answered with."""
        body_expected, content_type = has_body(scope["headers"])
        if body_expected and not is_json(content_type):
            await send(self.json.refusal_start)
            await send(self.json.refusal_body)
            return 415
        scope["route"] = route
        scope["endpoint"] = route.endpoint
        scope["path_params"] = {}
        chunks: list[bytes] = []
        received = 0

        async def checked_receive() -> Message:
            # BodyLimit's count, then JsonBodies' check, as the two wrappers did.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > limit:
                    raise HTTPException(413, f"request body over {limit} bytes")
                more = message.get("more_body", False)
                if body_expected:
                    if more or chunks:
                        chunks.append(chunk)
                    if not more:
                        body = b"".join(chunks) if chunks else chunk
                        field = duplicate_key(body) if body else None
                        if field is not None:
                            raise BadBody(422, f"{field}: repeated key in a JSON object", field)
            return message

        request = Request(scope, checked_receive)
        try:
            response = await route.endpoint(request)
        except Exception as exc:
            handler = handler_for(self._handlers, exc)
            if handler is None:
                raise
            response = await handler(request, exc)
        await response(scope, checked_receive, send)
        return int(response.status_code)


def handler_for(
    handlers: Mapping[Any, Callable[..., Any]], exc: Exception
) -> Callable[..., Any] | None:
    """The app's handler for ``exc`` as the exception middleware picks it: by status for
    HTTP errors, else by class; None for what only the server-error middleware's (the
    500 and ``Exception`` one) handles."""
    if isinstance(exc, HTTPException):
        found = handlers.get(exc.status_code)
        if found is not None and exc.status_code != 500:
            return found
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        found = handlers.get(cls)
        if found is not None:
            return found
    return None
