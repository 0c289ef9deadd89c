"""Property-based contract test: schemathesis drives the live service from openapi.yaml.

For every operation of the published contract schemathesis generates requests (valid ones,
and invalid ones that must be refused with a documented 4xx) and checks every answer against
openapi.yaml: no 5xx, a documented status code, a documented content type, a body matching the
documented schema. The service runs as a real process (``python -m service``) on a real
redis-server and on the memory store. The run is deterministic (derandomized, fixed seed) and
bounded: at most MAX_EXAMPLES generated examples per operation, plus the contract's own
examples.

``test_every_phase_and_check`` runs schemathesis's own runner the way its CLI documents it,
against the service on Redis:
every phase (examples, coverage, fuzzing and stateful sequences that follow the contract's
links) and ``--checks all`` (also: invalid data refused, valid data accepted, ``Allow`` on
405, missing headers, resources gone after DELETE), deterministic and bounded in examples
per operation and in time. tests/schemathesis.toml says which refusals the contract cannot
predict (and why); tests/schemathesis_hooks.py keeps the detector off and encodes names
with `%` in paths.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import requests
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.procs import ROOT, RedisServer, ServiceProcess
from tests.schemathesis_hooks import as_path_segment, prepare

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SPEC = ROOT / "openapi.yaml"
MAX_EXAMPLES = 50
SEED = 20251122

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

# GET /fault-items/stream is an endless text/event-stream. schemathesis reads event streams
# only up to max_stream_events complete events (or the request timeout), so one event (the
# snapshot) ends each request at once, and that event is checked against the media type's
# schema (an object with `event` and `data`) like any body.
# GET /metrics (text/plain) and GET / (text/html) keep every check: schemathesis has no
# deserializer for those media types, so for them response_schema_conformance passes without
# looking at the body, and status code and content type are what is checked.
config = schemathesis.Config(seed=SEED)
schema = schemathesis.openapi.from_path(SPEC, config=config)
schema.config.generation.update(max_examples=MAX_EXAMPLES, deterministic=True)
schema.config.max_stream_events = 1
# The boundary ("coverage") phase runs once, in test_every_phase_and_check's full run: its
# cases are generated while pytest collects (on every test worker) and are mostly bodies the
# edge refuses before any store is reached; run here too, on both stores, they took a
# quarter of the suite's schemathesis time for no check the full run does not make.
schema.config.phases.update(phases=["examples", "fuzzing"])

#: What the examples in openapi.yaml name (topic `orders`, `broker-a`), registered before the
#: run so that selects, route reads and fault items answer 200 with a body, not only 404.
SEED_ROUTE = {
    "brokers": [
        {"brokerName": "broker-a", "writeQueueNums": 4, "address": "10.0.0.5:10911"},
        {"brokerName": "broker-b", "writeQueueNums": 4},
    ]
}


def _populate(url: str) -> None:
    with httpx.Client(base_url=url, timeout=5) as c:
        c.put("/routes/orders", json=SEED_ROUTE).raise_for_status()
        c.post(
            "/report-latency", json={"brokerName": "broker-b", "latencyMs": 0, "isolation": True}
        ).raise_for_status()
        c.post(
            "/report-latency", json={"brokerName": "broker-a", "latencyMs": 20, "producer": "seed"}
        ).raise_for_status()


@pytest.fixture(scope="module", params=["redis", "memory"])
def service(request: pytest.FixtureRequest) -> Iterator[ServiceProcess]:
    """One service per store for the whole module (one start, not one per operation).

    The Redis one uses the session's redis-server, flushed first as ``redis_url`` does (that
    fixture is per test, too narrow for a module-wide service).
    """
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        with server.client() as c:
            c.flushall()
        proc = ServiceProcess(redis_url=server.url)
    else:
        proc = ServiceProcess()
    try:
        _populate(proc.url)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def session(service: ServiceProcess) -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


@schema.parametrize()
def test_api_conforms_to_openapi(
    case: schemathesis.Case, service: ServiceProcess, session: requests.Session
) -> None:
    prepare(case)
    case.call_and_validate(base_url=service.url, session=session, checks=CHECKS, timeout=10)


#: Examples per operation and phase in the full run, and its time bound (seconds).
FULL_RUN_EXAMPLES = 15
FULL_RUN_TIMEOUT_S = 400


@pytest.mark.timeout(FULL_RUN_TIMEOUT_S + 60)
# On Redis, the store deployments run: the phases' requests reach the stores through the
# same routes and edge, and the memory store is driven by test_api_conforms_to_openapi
# above and by the behaviour suite (a full run on it took 70 s more of a CI worker).
@pytest.mark.parametrize("service", ["redis"], indirect=True)
def test_every_phase_and_check(service: ServiceProcess, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
        "PYTHONPATH": str(ROOT),
        "NO_COLOR": "1",
    }
    cmd = [
        sys.executable, "-m", "schemathesis.cli",
        "--config-file", str(ROOT / "tests" / "schemathesis.toml"),
        "run", str(SPEC), "--url", service.url, "--checks", "all",
        "--phases", "examples,coverage,fuzzing,stateful",
        "--max-examples", str(FULL_RUN_EXAMPLES), "--generation-deterministic",
        "--request-timeout", "10", "--no-color",
    ]
    # Run from a scratch directory: schemathesis keeps a cache of crashes in its working
    # directory, and nothing of a run belongs in the repository.
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=FULL_RUN_TIMEOUT_S)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    for phase in ("Examples", "Coverage", "Fuzzing", "Stateful"):
        assert f"✅ {phase}" in out, out[-3000:]


def test_a_raw_name_from_a_response_is_encoded_before_it_goes_into_a_path() -> None:
    assert as_path_segment("Vna%1Ey") == "Vna%251Ey"  # raw: %1E would decode to a control char
    assert as_path_segment("broker-a") == "broker-a"
    assert as_path_segment("a%25b") == "a%25b"  # already encoded by the generator: kept
