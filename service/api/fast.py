"""The two calls every producer makes per send, served without FastAPI's per-request work.

`POST /select` and `POST /report-latency` are declared on FastAPI routers like every
other endpoint (that is what builds openapi.yaml), and the same endpoint functions
are also mounted as plain Starlette routes ahead of them, so requests skip dependency
solving, telemetry checks and response validation. The body is validated by
pydantic-core straight from bytes; the answer is written directly. Both stay inside
the app's middleware and exception handlers, so limits, metrics and the Error
schema are the same as everywhere else. docs/BENCHMARKS.md has the measurements.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from service.auth import Principal
from service.store import FaultStore

M = TypeVar("M", bound=BaseModel)
Endpoint = Callable[[Request], Any]


async def parse(request: Request, adapter: TypeAdapter[M]) -> M:
    """The request body as a model; errors are reported as FastAPI's would be (under `body`)."""
    try:
        return adapter.validate_json(await request.body() or b"null")
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
    principal: Principal | None = request.scope["state"].get("principal")
    if principal is None:
        return given or ""
    return f"{principal.name}/{given}" if given else principal.name


def voter_of(request: Request, given: str | None) -> str:
    """Who the isolation quorum counts a producer as: with tokens, the token's name alone
    (a holder cannot vote as many producers by varying ``producer``); else the id given."""
    principal: Principal | None = request.scope["state"].get("principal")
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


def mount_fast(app: FastAPI, routes: Iterable[tuple[str, Endpoint]]) -> None:
    """Put plain routes for these POST paths in front of the FastAPI-declared ones."""
    for path, endpoint in routes:
        app.router.routes.insert(0, _FastRoute(path, endpoint, methods=["POST"]))
