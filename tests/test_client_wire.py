"""The SDK's reading of what a select needs: fault items, answers, the select body."""

from __future__ import annotations

import json
from typing import Any

import pytest

from detour.client import wire
from detour.model import FaultItem, Why
from service.api.render import fault_event

pytestmark = pytest.mark.unit

ANSWER: dict[str, Any] = {
    "topic": "orders",
    "brokerName": "broker-c",
    "queueId": 2,
    "address": None,
    "decision": "available",
    "avoidedBrokers": [],
    "degraded": False,
    "panic": True,
    "dryRun": False,
    "unenforcedBrokers": ["broker-a", "broker-b"],
    "ordered": "remap",
    "probe": True,
}


@pytest.mark.parametrize(
    "item",
    [
        FaultItem("broker-a", 120, 1_764_000_030_000),
        FaultItem(
            "broker-a", 30000, 1_764_000_600_000, 3, (("p1", 1_764_000_000_000),), True, False
        ),
        FaultItem("broker-b", 0, 0, 0, (("p1", 5), ("p2", 7)), False, True),
        FaultItem("broker-c", 0, 1_764_000_600_000,
                  why=Why("isolation", 1_764_000_000_000, 3000, "orders-app")),
    ],
)
def test_a_fault_item_survives_the_stream(item: FaultItem) -> None:
    sent = json.loads(json.dumps(fault_event(item.broker_name, item)))
    assert wire.fault(sent) == item


def test_a_fault_item_from_an_older_service_has_none_of_the_policy_fields() -> None:
    item = wire.fault({"brokerName": "broker-a", "currentLatencyMs": 5, "availableAt": 9})
    assert item == FaultItem("broker-a", 5, 9)
    assert wire.fault({"brokerName": "broker-a", "deleted": True}) is None


@pytest.mark.parametrize(
    "bad",
    [{"reachable": "yes"}, {"suspects": [["p1"]]}, {"suspects": [["p1", "soon"]]},
     {"why": "isolation"}, {"why": {"reason": "latency"}}],
)
def test_a_malformed_fault_item_is_refused(bad: dict[str, Any]) -> None:
    body = {"brokerName": "broker-a", "currentLatencyMs": 5, "availableAt": 9, **bad}
    with pytest.raises((TypeError, ValueError, KeyError)):
        wire.fault(body)


def test_the_whole_answer_is_read() -> None:
    got = wire.selected(ANSWER, "orders")
    assert (got.panic, got.dry_run, got.unenforced_brokers, got.ordered, got.probe) == (
        True,
        False,
        ("broker-a", "broker-b"),
        "remap",
        True,
    )
    older = {k: v for k, v in ANSWER.items() if k in ("topic", "brokerName", "queueId", "decision")}
    got = wire.selected(older, "orders")
    assert (got.panic, got.dry_run, got.unenforced_brokers, got.ordered, got.probe) == (
        False,
        False,
        (),
        None,
        False,
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"panic": "true"},
        {"dryRun": 1},
        {"unenforcedBrokers": "broker-a"},
        {"ordered": "x"},
        {"probe": None},
    ],
)
def test_an_answer_with_a_wrong_policy_field_is_not_detours(bad: dict[str, Any]) -> None:
    with pytest.raises((TypeError, ValueError)):
        wire.selected({**ANSWER, **bad}, "orders")


def test_the_select_body_carries_producer_and_sharding_key_when_given() -> None:
    assert wire.select_body("orders", None) == {"topic": "orders", "lastBrokerName": None}
    assert wire.select_body("orders", "broker-a", "p1", "order-42") == {
        "topic": "orders",
        "lastBrokerName": "broker-a",
        "producer": "p1",
        "shardingKey": "order-42",
    }


@pytest.mark.parametrize("key", ["", "k" * 1025, 42])
def test_a_sharding_key_detour_would_refuse_is_refused_before_asking(key: object) -> None:
    with pytest.raises(ValueError):
        wire.check_sharding_key(key)  # type: ignore[arg-type]
    wire.check_sharding_key("k" * 1024)
