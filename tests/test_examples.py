"""The example producers in examples/ run against a real Detour and leave the table they should.

Each program registers its own topic and brokers (``<lang>-broker-a`` down, ``-b`` up), so they
share one service. A language is skipped only when its runtime is not installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.procs import ROOT, ServiceProcess, free_port

pytestmark = pytest.mark.e2e

RUN_TIMEOUT_S = 120
MESSAGES = 6
#: One attempt line, e.g. "message 3 attempt 2: broker=java-broker-b queue=1 ... -> ok in 2 ms".
ATTEMPT = re.compile(r"^message (\d+) attempt (\d+): broker=(\S+) .*-> (ok|FAILED)", re.M)


@dataclass(frozen=True)
class Example:
    lang: str
    argv: tuple[str, ...]
    needs: tuple[str, ...]  # executables that must be on PATH


EXAMPLES = [
    Example("java", ("java", "examples/java/DetourProducer.java"), ("java",)),
    Example("node", ("node", "examples/node/producer.mjs"), ("node",)),
    Example("curl", ("bash", "examples/curl.sh"), ("curl", "bash")),
]


def _params() -> list[object]:
    params: list[object] = []
    for ex in EXAMPLES:
        missing = [exe for exe in ex.needs if shutil.which(exe) is None]
        reason = f"{', '.join(missing)} not installed: cannot run the {ex.lang} example"
        params.append(pytest.param(ex, id=ex.lang,
                                   marks=pytest.mark.skipif(bool(missing), reason=reason)))
    return params


def _run(ex: Example, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ex.argv, url], cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def detour() -> Iterator[str]:
    svc = ServiceProcess()
    try:
        yield svc.url
    finally:
        svc.stop()


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("ex", _params())
def test_example_retries_on_b_and_leaves_a_isolated(ex: Example, detour: str) -> None:
    out = _run(ex, detour)
    log = f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert out.returncode == 0, log
    assert f"summary: {MESSAGES}/{MESSAGES} messages delivered" in out.stdout, log

    a, b = f"{ex.lang}-broker-a", f"{ex.lang}-broker-b"
    attempts = [(int(m), int(n), broker, result) for m, n, broker, result
                in ATTEMPT.findall(out.stdout)]
    assert {broker for _, _, broker, _ in attempts} == {a, b}, log
    # The stand-ins: a always fails, b always succeeds.
    assert all((result == "FAILED") == (broker == a) for _, _, broker, result in attempts), log
    # a is hit once (the route's round-robin reaches it within three messages); the failure is
    # reported, so the retry of that message goes to b and no later select returns a.
    failed = [(m, n) for m, n, broker, _ in attempts if broker == a]
    assert len(failed) == 1 and failed[0][1] == 1, log
    msg = failed[0][0]
    assert (msg, 2, b, "ok") in attempts, log
    # Every message ends with a success.
    assert {m for m, _, _, result in attempts if result == "ok"} == set(range(1, MESSAGES + 1))

    table = httpx.get(detour + "/fault-items", timeout=5).json()
    items = {item["brokerName"]: item for item in table["items"]}
    # The failure opened the isolation window: isolationLatencyMs 30000 -> 600 s by default.
    assert items[a]["available"] is False, items
    assert 590_000 <= items[a]["availableAt"] - table["now"] <= 600_000, items
    # b's successes were fast: below 550 ms, the first tier that would open a window.
    assert items[b]["available"] is True, items
    assert 0 <= items[b]["currentLatencyMs"] < 550, items


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("ex", _params())
def test_example_fails_without_detour(ex: Example) -> None:
    out = _run(ex, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert out.returncode == 2, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert "cannot register the route" in out.stdout
