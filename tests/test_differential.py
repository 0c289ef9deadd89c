"""Differential: on random configs and tables, the service and the SDK decide alike.

The service side is the function ``POST /select`` runs (``selector.choose_on``) on a
replica's view; the SDK side is ``LocalTable.select``, fed what the push stream would
send: the service's own encoders (service/api/render.py) turned into JSON and back
through the SDK's decoding (detour/client/wire.py). Both get the same random draws.
A field the stream forgets, or a rule only one side applies, shows as a difference.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detour import selector
from detour.client import wire
from detour.client.local import LocalTable
from detour.decide import Ask, answer
from detour.model import CONFIG_FIELDS, BrokerRoute, Config, FaultItem, Route
from detour.view import TableView
from service.api.render import config_out, fault_event, route_out
from service.store.base import ReportIn
from service.store.local import apply_locally
from tests.budget import examples

pytestmark = pytest.mark.unit

NOW = 1_764_000_000_000
BROKERS = tuple(f"broker-{c}" for c in "abcdefg")
PRODUCERS = ("p1", "p2", "p3")


def _field_value(name: str) -> st.SearchStrategy[Any]:
    f = next(f for f in CONFIG_FIELDS if f.name == name)
    if f.kind is bool:
        return st.booleans()
    if f.choices:
        return st.sampled_from(f.choices)
    if name.endswith("_percent"):
        return st.integers(0, 100)
    if name in ("isolation_quorum", "latency_quorum"):
        return st.integers(1, 4)
    if name == "pending_quorum":
        return st.integers(0, 3)
    assert f.ge is not None and f.le is not None
    return st.integers(f.ge, min(f.le, 1_000_000))


@st.composite
def configs(draw: st.DrawFn) -> Config:
    """Any config: every non-tier field drawn or left at its default, the tiers too."""
    values = {
        f.name: draw(_field_value(f.name))
        for f in CONFIG_FIELDS
        # the quorums always drawn: a producer's own windows need one above 1
        if f.kind is not tuple
        and (f.name in ("isolation_quorum", "latency_quorum") or draw(st.booleans()))
    }
    if draw(st.booleans()):
        tiers = sorted(draw(st.sets(st.integers(0, 40_000), min_size=1, max_size=6)))
        values["latency_max"] = tuple(tiers)
        values["not_available_duration"] = tuple(
            draw(st.lists(st.integers(0, 900_000), min_size=len(tiers), max_size=len(tiers)))
        )
    return Config(**values)


@st.composite
def situations(draw: st.DrawFn) -> tuple[Config, Route, dict[str, FaultItem], dict[str, Any]]:
    config = draw(configs())
    brokers = draw(st.lists(st.sampled_from(BROKERS), min_size=1, max_size=6, unique=True))
    route = Route.from_brokers(
        "orders", [BrokerRoute(b, draw(st.integers(1, 4)), None) for b in brokers]
    )
    producer = draw(st.sampled_from((None, *PRODUCERS)))
    faults: dict[str, FaultItem] = {}
    # mostly the route's brokers, sometimes one it does not have
    for b in draw(st.lists(st.sampled_from((*brokers, *brokers, *BROKERS)), max_size=7)):
        suspects = draw(
            st.lists(
                st.tuples(
                    st.sampled_from((producer or "p1", *PRODUCERS)),
                    st.integers(NOW - 900_000, NOW),
                ),
                max_size=3,
                unique_by=lambda s: s[0],
            )
        )
        slow = draw(
            st.lists(
                st.tuples(
                    st.sampled_from((producer or "p1", *PRODUCERS)),
                    st.integers(NOW - 200_000, NOW),
                    st.integers(0, 200_000),
                ),
                max_size=3,
                unique_by=lambda s: s[0],
            )
        )
        faults[b] = FaultItem(
            b,
            draw(st.integers(0, 40_000)),
            NOW + draw(st.integers(-900_000, 900_000)),
            draw(st.integers(0, 5)),
            tuple(suspects),
            draw(st.booleans()),
            draw(st.sampled_from((None, True, False))),
            tuple(sorted((p, at, at + length) for p, at, length in slow)),
            # in-flight signals (pendingQuorum): live, withdrawn (at 0), sometimes a hold
            tuple(
                draw(
                    st.lists(
                        st.tuples(
                            st.sampled_from((producer or "p1", *PRODUCERS, "~")),
                            st.integers(NOW - 200_000, NOW),
                            st.sampled_from((0, NOW - 50, NOW - 70_000)),
                        ),
                        max_size=3,
                        unique_by=lambda s: s[0],
                    )
                )
            ),
        )
    request = {
        "counter": draw(st.integers(0, 1 << 20)),
        "last": draw(st.sampled_from((None, *brokers))),
        "producer": producer,
        "key": draw(st.one_of(st.none(), st.text(min_size=1, max_size=20))),
        "seed": draw(st.integers(0, 1 << 30)),
        "latencies": draw(st.dictionaries(st.sampled_from(brokers), st.integers(0, 5000))),
    }
    return config, route, faults, request


def _json(value: Any) -> Any:
    """Through JSON text, as the stream carries it."""
    return json.loads(json.dumps(value))


@settings(max_examples=examples(), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(situations())
def test_service_and_sdk_decide_alike(
    situation: tuple[Config, Route, dict[str, FaultItem], dict[str, Any]],
) -> None:
    config, route, faults, r = situation

    service = TableView(lambda: NOW)
    service.apply_config(config, 1)
    service.apply_route(route.topic, route, 1)
    for b, item in faults.items():
        service.apply_fault(b, item, 1)

    sdk = LocalTable(lambda: NOW, r["producer"])
    sdk.replace(
        wire.config(_json(config_out(config).model_dump(mode="json"))),
        [wire.route(_json(route_out(route).model_dump(mode="json")))],
        {
            b: i
            for b, i in ((b, wire.fault(_json(fault_event(b, i)))) for b, i in faults.items())
            if i is not None
        },
    )
    for view in (service, sdk.view):
        view.set_counter(route.topic, r["counter"])
        for b, ms in r["latencies"].items():
            view.observe_latency(b, ms, NOW)

    # Two selects in a row: the second sees the counter and the probe the first left.
    for _ in range(2):
        choice = selector.choose_on(
            service, route, Ask(r["last"], r["producer"], r["key"]), random.Random(r["seed"])
        )
        selected = sdk.select(route.topic, r["last"], r["key"], random.Random(r["seed"]))

        assert selected is not None
        expect = answer(choice)
        assert (
            selected.broker_name,
            selected.queue_id,
            selected.decision.value,
            list(selected.avoided_brokers),
            selected.panic,
            selected.dry_run,
            list(selected.unenforced_brokers),
            selected.ordered,
            selected.probe,
        ) == (
            expect["brokerName"],
            expect["queueId"],
            expect["decision"],
            expect["avoidedBrokers"],
            expect["panic"],
            expect["dryRun"],
            expect["unenforcedBrokers"],
            expect["ordered"],
            expect["probe"],
        )
        assert sdk.view.counter(route.topic) == service.counter(route.topic)


@settings(max_examples=examples(), deadline=None)
@given(situations(), st.sampled_from(BROKERS), st.integers(0, 40_000), st.booleans())
def test_a_report_applied_by_the_sdk_is_the_services(
    situation: tuple[Config, Route, dict[str, FaultItem], dict[str, Any]],
    broker: str,
    latency: int,
    isolation: bool,
) -> None:
    """The SDK applies its own reports with the service's rule (quorum, backoff,
    probation), so its decision before Detour's push arrives is the one after it."""
    config, route, faults, r = situation
    if config.jitter_percent:
        config = Config.from_wire({**config.to_wire(), "jitterPercent": 0})
    service = TableView(lambda: NOW)
    service.apply_config(config, 1)
    for b, item in faults.items():
        service.apply_fault(b, item, 1)
    voter = r["producer"] or ""
    apply_locally(
        service,
        [ReportIn(broker, latency, isolation, 0, voter, None, voter)],
        NOW,
        10_000,
        lambda b: service.apply_fault(b, None, 2),
        lambda item: service.apply_fault(item.broker_name, item, 2),
        "default",
    )

    sdk = LocalTable(lambda: NOW, r["producer"])
    sdk.replace(config, [], dict(faults))
    sdk.apply_report(broker, latency, isolation)

    assert sdk.fault(broker) == service.faults.get(broker)
