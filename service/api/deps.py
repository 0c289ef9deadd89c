"""What route handlers receive through dependency injection."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Path, Request

from service.schemas import NAME_PATTERN, ErrorBody
from service.store import FaultStore


async def get_store(request: Request) -> FaultStore:
    # async on purpose: FastAPI runs a plain ``def`` dependency in a worker thread,
    # a hand-off that cost more than the whole select.
    store: FaultStore = request.state.store
    return store


async def get_stores(request: Request) -> dict[str, FaultStore]:
    stores: dict[str, FaultStore] = request.state.stores
    return stores


StoreDep = Annotated[FaultStore, Depends(get_store)]
#: Every namespace's store: for probes and metrics, which are not per tenant.
StoresDep = Annotated[dict[str, FaultStore], Depends(get_stores)]
TopicPath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=127,
        pattern=NAME_PATTERN,
        description="Topic name.",
        examples=["orders"],
    ),
]
BrokerPath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=127,
        pattern=NAME_PATTERN,
        alias="brokerName",
        description="Broker name.",
        examples=["broker-a"],
    ),
]

#: A log position (``after``, ``since``): a Redis stream id is two unsigned 64-bit
#: integers, ``ms-seq``. At most 19 digits each keeps both in range (2**64 - 1 has 20),
#: and leaves room after the largest, so a read "after" it is a valid range on both
#: stores; the ids Detour hands out (epoch ms) have 13. A longer one is a 422 naming the
#: parameter, not a store error.
STREAM_ID_PATTERN = r"^[0-9]{1,19}-[0-9]{1,19}$"

#: Error responses every route may give, for the OpenAPI document (a body may come with any
#: request, so 413, 415 and a repeated key's 422 too).
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {
        "model": ErrorBody,
        "description": "BAD_REQUEST: the HTTP parser refused the request (not HTTP/1.1 as "
        "written, an unknown method, control characters); the connection is closed.",
    },
    401: {
        "model": ErrorBody,
        "description": "Tokens are configured and this one is missing or unknown.",
    },
    403: {
        "model": ErrorBody,
        "description": "The token's role may not do this, or "
        "`X-Detour-Namespace` names another namespace than the token's.",
    },
    408: {
        "model": ErrorBody,
        "description": "REQUEST_TIMEOUT: the request line and headers, or the body, took "
        "longer than `DETOUR_HEADER_TIMEOUT_S` / `DETOUR_BODY_TIMEOUT_S`; the connection is "
        "closed.",
    },
    413: {
        "model": ErrorBody,
        "description": "PAYLOAD_TOO_LARGE: the body is over `DETOUR_MAX_BODY_BYTES` (64 KiB; "
        "256 KiB for the batch).",
    },
    415: {
        "model": ErrorBody,
        "description": "UNSUPPORTED_MEDIA_TYPE: a body without `Content-Type: application/json`.",
    },
    421: {
        "model": ErrorBody,
        "description": "HOST_NOT_ALLOWED: the Host is not a loopback name, an IP literal or one "
        "of `DETOUR_ALLOWED_HOSTS` (DNS rebinding); the connection is closed.",
    },
    422: {
        "model": ErrorBody,
        "description": "A field failed validation, or a JSON object repeats a key; `field` "
        "names it.",
    },
    431: {
        "model": ErrorBody,
        "description": "HEADERS_TOO_LARGE: request line and headers over "
        "`DETOUR_MAX_HEADER_BYTES`, or more than `DETOUR_MAX_HEADERS` headers; the connection "
        "is closed.",
    },
}
UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: {
        "model": ErrorBody,
        "description": "SYSTEM_BUSY: overloaded, refused at once (see Retry-After; decide "
        "locally); STORE_UNAVAILABLE: Redis did not answer.",
    }
}


def not_found(what: str) -> dict[int | str, dict[str, Any]]:
    return {404: {"model": ErrorBody, "description": what}}
