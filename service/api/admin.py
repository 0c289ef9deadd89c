"""Operator endpoints: the strategy's config and the fault table."""

from __future__ import annotations

from fastapi import APIRouter, Response

from service.api.deps import ERRORS, UNAVAILABLE, BrokerPath, StoreDep, not_found
from service.errors import NotFound
from service.model import Config
from service.schemas import ConfigBody, FaultItemOut, FaultItemsOut

router = APIRouter(tags=["admin"])


def _config_out(c: Config) -> ConfigBody:
    return ConfigBody(
        send_latency_fault_enable=c.send_latency_fault_enable,
        latency_max=list(c.latency_max),
        not_available_duration=list(c.not_available_duration),
        isolation_latency_ms=c.isolation_latency_ms,
        last_report_wins=c.last_report_wins,
    )


@router.get("/config", response_model=ConfigBody, summary="The fault strategy's config")
async def get_config(store: StoreDep) -> ConfigBody:
    return _config_out(store.view.config)


@router.put(
    "/config",
    response_model=ConfigBody,
    responses={**ERRORS, **UNAVAILABLE},
    summary="Replace the config; omitted fields take their defaults",
)
async def put_config(body: ConfigBody, store: StoreDep) -> ConfigBody:
    """Replace the deployment's config; every replica follows within a second."""
    config = Config(
        send_latency_fault_enable=body.send_latency_fault_enable,
        latency_max=tuple(body.latency_max),
        not_available_duration=tuple(body.not_available_duration),
        isolation_latency_ms=body.isolation_latency_ms,
        last_report_wins=body.last_report_wins,
    )
    await store.put_config(config)
    return _config_out(config)


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
