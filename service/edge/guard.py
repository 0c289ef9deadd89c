"""The token check in front of every route: who is calling, may they, and on which table.

Installed only when tokens are configured, so an open sidecar on loopback pays
nothing. It runs before routing and before any body is read: a request without a
valid token costs a header lookup and one hash. On success it points the request
at its namespace's store (``request.state.store``, what every handler uses) and
records the principal (``request.state.principal``) for reporter identity.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from service.auth import Principal, TokenTable, requires_token
from service.edge.answers import send_error

#: Optional request header naming the namespace the caller means; a mismatch with
#: the token's namespace is refused rather than silently served from the token's.
NAMESPACE_HEADER = b"x-detour-namespace"


def credentials(headers: Iterable[tuple[bytes, bytes]]) -> tuple[str | None, str | None]:
    """The bearer token and the namespace asked for, each None when absent."""
    token = None
    wanted_ns = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, rest = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and rest.strip():
                token = rest.strip()
        elif name == NAMESPACE_HEADER:
            wanted_ns = value.decode("latin-1")
    return token, wanted_ns


def admitted(
    tokens: TokenTable, headers: Iterable[tuple[bytes, bytes]], method: str, path: str
) -> Principal | None:
    """The caller's principal when ``Guard`` would let the request through, else None
    (the direct lane then leaves the request to ``Guard``, which says why)."""
    token, wanted_ns = credentials(headers)
    principal = tokens.lookup(token) if token else None
    if principal is None or (wanted_ns is not None and wanted_ns != principal.namespace):
        return None
    return principal if principal.may(method, path) else None


class Guard:
    def __init__(self, app: ASGIApp, tokens: TokenTable) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not requires_token(scope["path"]):
            await self.app(scope, receive, send)
            return
        token, wanted_ns = credentials(scope["headers"])
        principal: Principal | None = self.tokens.lookup(token) if token else None
        if principal is None:
            await send_error(
                send,
                401,
                "UNAUTHORIZED",
                "a valid token is required: Authorization: Bearer <token>"
                if token is None
                else "unknown token",
                "Authorization",
                ((b"www-authenticate", b'Bearer realm="detour"'),),
            )
            return
        if wanted_ns is not None and wanted_ns != principal.namespace:
            await send_error(
                send,
                403,
                "FORBIDDEN",
                f"this token is for namespace {principal.namespace!r}, not {wanted_ns!r}",
                "X-Detour-Namespace",
            )
            return
        if not principal.may(scope["method"], scope["path"]):
            await send_error(
                send,
                403,
                "FORBIDDEN",
                f"role {principal.role.value!r} may not {scope['method']} {scope['path']}",
                "Authorization",
            )
            return
        state = scope["state"]
        if principal.namespace in state["stores"]:  # not a metrics token for every one ("*")
            state["store"] = state["stores"][principal.namespace]
        state["principal"] = principal
        await self.app(scope, receive, send)
