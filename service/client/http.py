"""Calls to Detour over httpx, sorted into "answered" and "unavailable".

Everything the fail-open rule needs to know about a call is decided here, the
same way for the sync and async clients:

* a timeout, a refused or reset connection, a 5xx (503 is Detour shedding load
  or its store being down), a 429, or a 2xx that is not JSON: ``DetourUnavailable``,
  and the client falls back to its local table;
* any other 4xx: ``DetourRequestError`` (``TopicNotFound`` for a select's 404),
  because retrying a wrong request elsewhere would hide a programming mistake.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from service.client import wire
from service.client.errors import DetourRequestError, DetourUnavailable

USER_AGENT = "detour-python/0.1"


def headers(token: str | None) -> dict[str, str]:
    out = {"User-Agent": USER_AGENT, "Accept": "application/json"}
    if token:
        out["Authorization"] = f"Bearer {token}"
    return out


def interpret(response: httpx.Response, what: str) -> Any:
    """The JSON of an answer (None for an empty one); raises as the module docstring says."""
    status = response.status_code
    if 200 <= status < 300:
        if not response.content:
            return None
        try:
            return json.loads(response.content)
        except ValueError as exc:
            raise DetourUnavailable(f"{what}: answer is not JSON") from exc
    if status >= 500 or status == 429:
        raise DetourUnavailable(f"{what}: HTTP {status}")
    try:
        body: object = json.loads(response.content)
    except ValueError:
        body = response.text
    code, message, field = wire.error_fields(body)
    raise DetourRequestError(status, code, message, field)


class SyncHTTP:
    """One pooled ``httpx.Client`` (keep-alive connections, shareable between threads).

    ``timeout`` (s) bounds each phase of a call (connect, write, read, pool wait).
    """

    def __init__(
        self,
        base_url: str,
        timeout: float,
        token: str | None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.client = httpx.Client(
            base_url=base_url,
            timeout=httpx.Timeout(timeout),
            headers=headers(token),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            transport=transport,
        )

    def call(self, method: str, path: str, body: object = None) -> Any:
        """Raises DetourUnavailable or DetourRequestError (see the module docstring)."""
        what = f"{method} {path}"
        try:
            response = self.client.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise DetourUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc
        return interpret(response, what)

    def close(self) -> None:
        self.client.close()


class AsyncHTTP:
    """One pooled ``httpx.AsyncClient``; ``timeout`` (s) bounds each call as a whole."""

    def __init__(
        self,
        base_url: str,
        timeout: float,
        token: str | None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.timeout = timeout
        self.client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(timeout),
            headers=headers(token),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            transport=transport,
        )

    async def call(self, method: str, path: str, body: object = None) -> Any:
        """Raises DetourUnavailable or DetourRequestError (see the module docstring)."""
        what = f"{method} {path}"
        try:
            async with asyncio.timeout(self.timeout):
                response = await self.client.request(method, path, json=body)
        except TimeoutError as exc:
            raise DetourUnavailable(f"{what}: no answer within {self.timeout} s") from exc
        except httpx.TransportError as exc:
            raise DetourUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc
        return interpret(response, what)

    async def aclose(self) -> None:
        await self.client.aclose()
