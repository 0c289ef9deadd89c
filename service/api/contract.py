"""What openapi.yaml says about tokens, declared the FastAPI way (no patch of ``app.openapi``).

Bearer tokens (service/auth.py) are checked by the edge's guard, before any route; the
routes only declare them, so that the contract lists the scheme and, per operation, who
may call. A route that needs a token depends on ``TOKEN`` (an ``HTTPBearer`` that never
refuses: with ``auto_error=False`` it only reads the header), which puts the scheme in the
document's components and on the operation; ``describe_security`` adds, through each
route's ``openapi_extra``, the empty alternative (a deployment without tokens asks for
none) and ``x-detour-role``, the least role that may call.
"""

from __future__ import annotations

from fastapi import APIRouter, Security
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from starlette.routing import BaseRoute

from service.auth import Principal, Role, requires_token

BEARER = HTTPBearer(
    scheme_name="bearerToken",
    description="A token from the deployment's tokens file (docs/security.md); needed only "
    "when tokens are configured.",
    auto_error=False,
)
#: The dependency of every route that needs a token when tokens are configured.
TOKEN = Security(BEARER)


def included(token: tuple[APIRouter, ...], open_: tuple[APIRouter, ...]) -> tuple[BaseRoute, ...]:
    """The app's routes: the routers of ``token`` (their routes need a token when tokens are
    configured; one that does not, ``/metrics``, depends on ``TOKEN`` itself), then those
    of ``open_``, each included once per process.

    Every app of the process takes these same inclusions (``FastAPI(routes=...)``).
    FastAPI works out an inclusion's routes (their dependencies, parameters and response
    fields) on its first request and keeps them in the inclusion, so an inclusion per app
    made every app pay for that again: the test suite creates an app per test
    (tests/README.md has the cost)."""
    key = (tuple(map(id, token)), tuple(map(id, open_)))
    if key not in _INCLUDED:
        holder = APIRouter()
        for router in token:
            describe_security(router)
            holder.include_router(router, dependencies=[TOKEN])
        for router in open_:
            describe_security(router)
            holder.include_router(router)
        _INCLUDED[key] = tuple(holder.routes)
    return _INCLUDED[key]


#: ``included``'s inclusions, by the routers' identities (a router is not hashable).
_INCLUDED: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[BaseRoute, ...]] = {}


def describe_security(router: APIRouter) -> None:
    """Each operation's security alternatives and least role, in its ``openapi_extra``
    (FastAPI merges it into the operation, lists appended). Set on the router's own routes
    before it is included: an inclusion copies them."""
    for route in router.routes:
        if not isinstance(route, APIRoute):
            continue
        extra = dict(route.openapi_extra or {})
        if not requires_token(route.path):
            extra["security"] = []
        else:
            extra["security"] = [{}]
            method = min(route.methods or {"GET"})
            extra["x-detour-role"] = next(
                r.value
                for r in (Role.PRODUCER, Role.METRICS, Role.ADMIN)
                if Principal("", r, "").may(method, route.path)
            )
        route.openapi_extra = extra
