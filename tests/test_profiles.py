"""Out of the box a table runs the settings docs/policy.md recommends for a shared table,
and exact RocketMQ 4.x is one word away (detour/profiles.py; docs/policy.md, "Profiles").

The rest of the suite runs on the ``rocketmq-4`` profile (tests/conftest.py); here the
default is the point, so each app is built with its profile named.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from detour.model import Config
from detour.profiles import PROFILES, RECOMMENDED, ROCKETMQ_4, profile_of
from service.app import create_app
from service.settings import Settings
from tests.asgi_client import TestClient
from tests.procs import PATIENT_CALL_TIMEOUT_S

ROUTE = {"brokers": [{"brokerName": b, "writeQueueNums": 2} for b in "abcd"]}


def app_on(store_kind: str, request: pytest.FixtureRequest, **fields: Any) -> TestClient:
    if store_kind == "redis":
        fields |= {"redis_url": request.getfixturevalue("redis_url"),
                   "redis_call_timeout_s": PATIENT_CALL_TIMEOUT_S}
    return TestClient(create_app(Settings(**fields)))


@pytest.fixture
def fresh(store_kind: str, request: pytest.FixtureRequest) -> Iterator[TestClient]:
    """A new table with no profile named: what `make run` and a new deployment get."""
    with app_on(store_kind, request, profile=Settings.model_fields["profile"].default) as c:
        yield c


@pytest.mark.unit
def test_the_profiles_are_whole_configs_and_rocketmq_is_every_fields_default() -> None:
    assert ROCKETMQ_4 == Config()
    assert RECOMMENDED != ROCKETMQ_4
    assert (RECOMMENDED.latency_quorum, RECOMMENDED.pending_quorum, RECOMMENDED.ramp_ms) == (
        2, 2, 3000)
    assert RECOMMENDED.early_recovery and RECOMMENDED.detector_enable
    assert {profile_of(p) for p in PROFILES.values()} == set(PROFILES)
    assert profile_of(Config(latency_quorum=3)) is None
    assert Settings.model_fields["profile"].default == "recommended"


@pytest.mark.integration
def test_a_new_table_starts_recommended(fresh: TestClient) -> None:
    body = fresh.get("/config").json()
    assert body["profile"] == "recommended"
    assert Config.from_wire(body) == RECOMMENDED


@pytest.mark.integration
def test_rocketmq_4_is_one_patch_away_and_back(fresh: TestClient) -> None:
    r = fresh.patch("/config", json={"profile": "rocketmq-4"})
    assert r.status_code == 200 and r.json()["profile"] == "rocketmq-4"
    assert Config.from_wire(fresh.get("/config").json()) == ROCKETMQ_4
    # a profile with a field on top: the profile, then the field; a config of its own
    r = fresh.patch("/config", json={"profile": "recommended", "rampMs": 1000})
    body = r.json()
    assert body["profile"] is None and body["rampMs"] == 1000 and body["latencyQuorum"] == 2
    # an unknown profile changes nothing and names the field
    r = fresh.patch("/config", json={"profile": "rocketmq-5", "latencyQuorum": 9})
    assert r.status_code == 422 and r.json()["field"] == "profile"
    assert fresh.get("/config").json()["rampMs"] == 1000
    # GET's body, profile and all, can be PUT back as it is
    assert fresh.put("/config", json=fresh.get("/config").json()).status_code == 200


@pytest.mark.integration
def test_the_suite_runs_rocketmq_4_unless_a_test_names_another(client: TestClient) -> None:
    """The conformance and behaviour suites' tables start as exact RocketMQ 4.x."""
    assert client.get("/config").json()["profile"] == "rocketmq-4"


@pytest.mark.integration
def test_out_of_the_box_one_producers_slow_send_avoids_the_broker_for_it_alone(
    fresh: TestClient,
) -> None:
    """The walkthrough's first cold send (2,264 ms) avoided broker a for every producer for
    120 s under RocketMQ's rules on a shared table. Out of the box it is avoided by the
    producer that saw it, as its own RocketMQ table would, until a second producer agrees."""
    assert fresh.put("/routes/orders", json=ROUTE).status_code == 200
    r = fresh.post("/report-latency", json={"brokerName": "a", "latencyMs": 2264,
                                            "producer": "cold"})
    assert r.status_code == 200

    def picks(producer: str) -> set[str]:
        out = set()
        for _ in range(16):
            r = fresh.post("/select", json={"topic": "orders", "producer": producer})
            assert r.status_code == 200
            out.add(r.json()["brokerName"])
        return out

    assert picks("other") == set("abcd")  # every other producer still uses a
    assert "a" not in picks("cold")  # the one that saw it avoids it
    fresh.post("/report-latency", json={"brokerName": "a", "latencyMs": 2300,
                                        "producer": "second"})
    assert "a" not in picks("other")  # two producers agree: avoided for all


@pytest.mark.integration
def test_under_rocketmq_4_one_slow_send_avoids_the_broker_for_everyone(
    fresh: TestClient,
) -> None:
    """The same report under the rocketmq-4 profile: RocketMQ's rule on one shared table."""
    assert fresh.patch("/config", json={"profile": "rocketmq-4"}).status_code == 200
    assert fresh.put("/routes/orders", json=ROUTE).status_code == 200
    fresh.post("/report-latency", json={"brokerName": "a", "latencyMs": 2264,
                                        "producer": "cold"})
    for _ in range(16):
        r = fresh.post("/select", json={"topic": "orders", "producer": "other"})
        assert r.json()["brokerName"] != "a"
