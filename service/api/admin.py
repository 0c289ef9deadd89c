"""Operator endpoints: the strategy's config and the fault table."""

from __future__ import annotations

from fastapi import APIRouter, Response

from service.api.deps import ERRORS, UNAVAILABLE, BrokerPath, StoreDep, not_found
from service.api.render import config_in, config_out
from service.errors import NotFound
from service.schemas import ConfigBody, FaultItemOut, FaultItemsOut

router = APIRouter(tags=["admin"])


@router.get("/config", response_model=ConfigBody, summary="The fault strategy's config")
async def get_config(store: StoreDep) -> ConfigBody:
    return config_out(store.view.config)


@router.put(
    "/config",
    response_model=ConfigBody,
    responses={**ERRORS, **UNAVAILABLE},
    summary="Replace the config; omitted fields take their defaults",
)
async def put_config(body: ConfigBody, store: StoreDep) -> ConfigBody:
    """Replace the deployment's config; every replica follows within a second."""
    config = config_in(body)
    await store.put_config(config)
    return config_out(config)


@router.get(
    "/fault-items",
    response_model=FaultItemsOut,
    responses=UNAVAILABLE,
    summary="The fault table, read from the store",
)
async def fault_items(store: StoreDep) -> FaultItemsOut:
    now, items = await store.fault_items()
    return FaultItemsOut(
        now=now,
        items=[
            FaultItemOut(
                broker_name=i.broker_name,
                current_latency_ms=i.current_latency_ms,
                available_at=i.available_at,
                available=i.is_available(now),
                probation=i.probation,
                reachable=i.reachable,
            )
            for i in sorted(items, key=lambda i: i.broker_name)
        ],
    )


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
