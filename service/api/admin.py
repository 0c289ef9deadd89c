"""Operator endpoints: the strategy's config and the fault table."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter

from detour.model import CONFIG_FIELDS, Config
from detour.profiles import PROFILES
from service.api.bodies import parse, request_body, validated
from service.api.deps import ERRORS, UNAVAILABLE, BrokerPath, StoreDep, not_found
from service.api.render import config_in, config_out
from service.api.table_answer import TableAnswers
from service.errors import NotFound
from service.schemas import ConfigBody, ConfigPatch, ConfigReplace, FaultItemsOut

#: RFC 7396's media type
MERGE_PATCH = "application/merge-patch+json"
PATCH = TypeAdapter(ConfigPatch)
REPLACE = TypeAdapter(ConfigReplace)
WHOLE = TypeAdapter(ConfigBody)
CONFIG_BY_NAME = {f.name: f for f in CONFIG_FIELDS}

router = APIRouter(tags=["admin"])


@router.get("/config", response_model=ConfigBody, summary="The fault strategy's config")
async def get_config(store: StoreDep) -> ConfigBody:
    return config_out(store.view.config)


@router.put(
    "/config",
    response_model=ConfigBody,
    responses={**ERRORS, **UNAVAILABLE},
    summary="Replace the whole config: every field (PATCH changes some)",
    openapi_extra=request_body(ConfigReplace),
)
async def put_config(request: Request, store: StoreDep) -> ConfigBody:
    """Replace the deployment's config with a whole one: every field must be there (a body
    that leaves some out is refused with 422 naming them, so a partial write never puts the
    others back to their defaults: `PATCH /config` is the partial change). Every replica
    follows within a second."""
    try:
        body = await parse(request, REPLACE)
    except RequestValidationError as exc:
        missing = [e["loc"][-1] for e in exc.errors() if e["type"] == "missing"]
        if not missing:
            raise
        raise RequestValidationError(
            [
                {
                    "type": "missing",
                    "loc": ("body", missing[0]),
                    "msg": f"a PUT replaces the whole config, and {len(missing)} field(s) are "
                    f"missing: {', '.join(map(str, missing))} (PATCH /config changes only the "
                    "fields it names)",
                    "input": None,
                }
            ]
        ) from None
    config = config_in(body)
    await store.put_config(config)
    return config_out(config)


@router.patch(
    "/config",
    response_model=ConfigBody,
    responses={**ERRORS, **UNAVAILABLE},
    summary="Change the fields named; the others stay (JSON merge patch)",
    openapi_extra=request_body(ConfigPatch, (MERGE_PATCH, "application/json")),
)
async def patch_config(request: Request, store: StoreDep) -> ConfigBody:
    """A JSON merge patch of the config (RFC 7396, `Content-Type:
    application/merge-patch+json`; `application/json` is taken too): the fields named
    change, the rest stay as they are, `null` puts a field back to its default. The result
    is checked as a whole (422 naming the field) and written atomically: a change another
    replica made meanwhile is kept, this one applied on top of it."""
    patch = await parse(request, PATCH)
    named = {
        CONFIG_BY_NAME[name]: getattr(patch, name)
        for name in patch.model_fields_set
        if name != "profile"
    }
    profile: str | None = getattr(patch, "profile", None)
    base = None if profile is None else PROFILES[profile]

    def update(current: Config) -> Config:
        wire = (current if base is None else base).to_wire()
        for f, value in named.items():
            wire[f.wire] = (
                (list(f.default) if f.kind is tuple else f.default) if value is None else value
            )
        return config_in(validated(WHOLE, json.dumps(wire).encode()))

    return config_out(await store.patch_config(update))


@router.get(
    "/fault-items",
    response_model=FaultItemsOut,
    responses=UNAVAILABLE,
    summary="The fault table, read from the store",
)
async def fault_items(request: Request, store: StoreDep) -> Response:
    now, items = await store.fault_items()
    answers: TableAnswers = request.app.state.table_answers
    return Response(answers.body(store, now, items), media_type="application/json")


@router.delete(
    "/fault-items/{brokerName}",
    status_code=204,
    response_class=Response,
    responses={**ERRORS, **UNAVAILABLE, **not_found("No fault item.")},
    summary="Restore a broker: drop its fault item",
)
async def delete_fault_item(broker_name: BrokerPath, store: StoreDep) -> Response:
    if not await store.delete_fault(broker_name):
        raise NotFound(f"no fault item for broker {broker_name!r}", field="brokerName")
    return Response(status_code=204)
