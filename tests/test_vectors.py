"""The decision vectors (docs/vectors/select.json): current, and decided alike by every side.

The corpus is written by the pure core (``make vectors``: docs/vectors/generate.py). Each case is
replayed through the three deciders producers meet: the function ``POST /select`` runs
(``detour.selector.choose_on`` on a replica's view), the route itself (the app, its
view holding the case's table), and the SDK's in-process select (``LocalTable``, fed
through the SDK's own decoding of the stream's JSON). Each must give the recorded
decision and leave the topic's counter where the case says.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from collections import Counter
from typing import Any

import pytest

from detour import selector
from detour.client import wire
from detour.client.local import LocalTable
from detour.decide import Ask, answer
from detour.model import BrokerRoute, Config, FaultItem, Route
from detour.policy import on_probation
from detour.view import TableView
from service.app import create_app
from service.settings import Settings
from tests.asgi_client import TestClient
from tests.procs import ROOT


def _load_generator() -> Any:
    """docs/vectors/generate.py lives beside the corpus, in no package: loaded by path."""
    spec = importlib.util.spec_from_file_location(
        "detour_vectors", ROOT / "docs" / "vectors" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclass-free, but keep pickling and typing happy
    spec.loader.exec_module(module)
    return module


vectors = _load_generator()
CASES: list[dict[str, Any]] = json.loads(vectors.PATH.read_text(encoding="utf-8"))["cases"]


class FixedDraws(random.Random):
    """A generator that hands out one case's draws, in the order ``decide.draw`` asks."""

    def __init__(self, case: dict[str, Any]) -> None:
        super().__init__(0)
        d = case["draws"]
        enforced = case["config"].get("enforcementPercent", 100) < 100
        # decide.draw's floats in its order: the enforcement roll (when read), the ramp's
        self._floats = [float(d["enforce"])] * enforced + [float(d["ramp"])]
        self._bits = [int(d["p2cFirst"]), int(d["p2cSecond"])]

    def random(self) -> float:
        return self._floats.pop(0)

    def getrandbits(self, k: int) -> int:
        return self._bits.pop(0)


def _server_fault(body: dict[str, Any]) -> FaultItem:
    return FaultItem(
        body["brokerName"],
        body["currentLatencyMs"],
        body["availableAt"],
        body["isolations"],
        tuple((who, at) for who, at in body["suspects"]),
        body["probation"],
        body["reachable"],
        tuple((who, at, end) for who, at, end in body["slow"]),
    )


def _server_route(body: dict[str, Any]) -> Route:
    return Route.from_brokers(
        body["topic"],
        [BrokerRoute(b["brokerName"], b["writeQueueNums"], b["address"]) for b in body["brokers"]],
    )


def _decider_state(view: TableView, case: dict[str, Any]) -> None:
    """The decider's own state the case names: the counter, its p2c scores, and which
    probes it has handed out already (on probation, not among the case's probes)."""
    now, topic = case["now"], case["route"]["topic"]
    view.set_counter(topic, case["counter"])
    for broker, score in case["scores"].items():
        view.observe_latency(broker, score, now)
    for broker, item in view.faults.items():
        if on_probation(item, now, view.config) and broker not in case["probes"]:
            view.probe_sent(broker, now)


def _ask(case: dict[str, Any]) -> Ask:
    r = case["request"]
    return Ask(r["lastBrokerName"], r["producer"], r["shardingKey"])


def _sdk_answer(selected: Any) -> dict[str, Any]:
    return {
        "brokerName": selected.broker_name,
        "queueId": selected.queue_id,
        "decision": selected.decision.value,
        "avoidedBrokers": list(selected.avoided_brokers),
        "panic": selected.panic,
        "dryRun": selected.dry_run,
        "unenforcedBrokers": list(selected.unenforced_brokers),
        "ordered": selected.ordered,
        "probe": selected.probe,
    }


def _without_counter(expect: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in expect.items() if k != "nextCounter"}


@pytest.mark.unit
def test_the_checked_in_corpus_is_what_the_generator_writes() -> None:
    assert vectors.PATH.read_text(encoding="utf-8") == vectors.render(), (
        "docs/vectors/select.json is stale: run `make vectors`"
    )


@pytest.mark.unit
def test_the_corpus_exercises_every_kind_of_decision() -> None:
    seen: Counter[str] = Counter()
    for case in CASES:
        e = case["expect"]
        seen[e["decision"]] += 1
        seen[f"ordered {e['ordered']}"] += 1
        for flag in ("panic", "dryRun", "probe"):
            seen[flag] += e[flag]
        seen["unenforced"] += bool(e["unenforcedBrokers"])
        seen["avoided"] += bool(e["avoidedBrokers"])
        seen["p2c"] += case["config"]["selection"] == "p2c-ewma"
        seen["producer window"] += case["config"]["isolationQuorum"] > 1 and any(
            f["suspects"] for f in case["faults"]
        )
        seen["slow window"] += case["config"]["latencyQuorum"] > 1 and any(
            f["slow"] for f in case["faults"]
        )
    wanted = (
        "available pick_one_at_least round_robin panic dryRun probe unenforced avoided p2c".split()
        + ["ordered home", "ordered wait", "ordered remap", "producer window", "slow window"]
    )
    for what in wanted:
        assert seen[what] >= 2, f"the corpus has too few cases of {what}: {seen}"


@pytest.mark.unit
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_service_selector_decides_every_vector(case: dict[str, Any]) -> None:
    view = TableView(lambda: case["now"])
    view.apply_config(Config.from_wire(case["config"]), 1)
    route = _server_route(case["route"])
    view.apply_route(route.topic, route, 1)
    for f in case["faults"]:
        view.apply_fault(f["brokerName"], _server_fault(f), 1)
    _decider_state(view, case)

    choice = selector.choose_on(view, route, _ask(case), FixedDraws(case))

    assert answer(choice) == case["expect"]
    assert view.counter(route.topic) == case["expect"]["nextCounter"] & 0x7FFFFFFF


@pytest.mark.unit
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_sdk_decides_every_vector(case: dict[str, Any]) -> None:
    table = LocalTable(lambda: case["now"], case["request"]["producer"])
    faults = {f["brokerName"]: wire.fault(f) for f in case["faults"]}
    table.replace(
        wire.config(case["config"]),
        [wire.route(case["route"])],
        {b: i for b, i in faults.items() if i is not None},
    )
    _decider_state(table.view, case)
    r = case["request"]

    selected = table.select(r["topic"], r["lastBrokerName"], r["shardingKey"], FixedDraws(case))

    assert selected is not None and selected.local
    assert _sdk_answer(selected) == _without_counter(case["expect"])
    assert table.view.counter(r["topic"]) == case["expect"]["nextCounter"] & 0x7FFFFFFF


@pytest.mark.unit
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_sdk_decides_every_vector_again_from_its_kept_answers(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first attempt on the selector's own generator may be answered from the SDK's kept
    answers (detour.memo): the case decided, the counter put back, and decided again
    is the case's answer both times (once for a probe, which changes what the next select
    sees)."""
    table = LocalTable(lambda: case["now"], case["request"]["producer"])
    faults = {f["brokerName"]: wire.fault(f) for f in case["faults"]}
    table.replace(
        wire.config(case["config"]),
        [wire.route(case["route"])],
        {b: i for b, i in faults.items() if i is not None},
    )
    _decider_state(table.view, case)
    r = case["request"]

    for _ in range(1 if case["expect"]["probe"] else 2):
        monkeypatch.setattr(selector, "_rng", FixedDraws(case))
        table.view.set_counter(r["topic"], case["counter"])
        selected = table.select(r["topic"], r["lastBrokerName"], r["shardingKey"])

        assert selected is not None and selected.local
        assert _sdk_answer(selected) == _without_counter(case["expect"])
        assert table.view.counter(r["topic"]) == case["expect"]["nextCounter"] & 0x7FFFFFFF


@pytest.mark.integration
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_post_select_answers_every_vector(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the app (its own per case: the view's scores and probes start empty): the
    route's JSON answer carries the case's decision."""
    monkeypatch.setattr(selector, "_rng", FixedDraws(case))
    with TestClient(create_app(Settings())) as client:
        view: TableView = client.app_state["store"].view
        monkeypatch.setattr(view, "now_ms", lambda: case["now"])
        version = view.version + 1
        view.apply_config(Config.from_wire(case["config"]), version)
        route = _server_route(case["route"])
        view.apply_route(route.topic, route, version)
        for f in case["faults"]:
            view.apply_fault(f["brokerName"], _server_fault(f), version)
        _decider_state(view, case)
        body = {k: v for k, v in case["request"].items() if v is not None}

        got = client.post("/select", json=body)

        assert got.status_code == 200, got.text
        answered = got.json()
        expect = _without_counter(case["expect"])
        assert {k: answered[k] for k in expect} == expect
        assert answered["topic"] == route.topic and answered["degraded"] is False
        assert answered["address"] == route.addresses[expect["brokerName"]]
        assert view.counter(route.topic) == case["expect"]["nextCounter"] & 0x7FFFFFFF
