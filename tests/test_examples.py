"""The example producers in examples/ run against a real Detour and leave the table they should.

Each program registers its own topic and brokers (``<lang>-broker-a`` down, ``-b`` up), so they
share one service. A language is skipped only when its runtime is not installed. The same
programs also run against a Detour with tokens: with an admin token in ``DETOUR_TOKEN`` they
work, without one (or with a producer token, which may not register a route) they stop at the
route with exit 2 and the status Detour answered.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.procs import ROOT, ServiceProcess, free_port, write_tokens

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


def _run(ex: Example, url: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run an example; ``DETOUR_TOKEN`` is exactly ``token`` (unset when None)."""
    env = {k: v for k, v in os.environ.items() if k != "DETOUR_TOKEN"}
    if token is not None:
        env["DETOUR_TOKEN"] = token
    return subprocess.run([*ex.argv, url], cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=env)


@pytest.fixture(scope="module")
def detour() -> Iterator[str]:
    svc = ServiceProcess()
    try:
        yield svc.url
    finally:
        svc.stop()


@dataclass(frozen=True)
class Secured:
    url: str
    admin: str
    producer: str


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """Detour with a tokens file: an admin and a producer token of namespace ``examples``."""
    admin, producer = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    tokens = write_tokens(tmp_path_factory.mktemp("auth") / "tokens.json", {
        "ops": (admin, "admin", "examples"), "app": (producer, "producer", "examples")})
    with ServiceProcess(env={"DETOUR_TOKENS_FILE": str(tokens)}) as svc:
        yield Secured(svc.url, admin, producer)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("ex", _params())
def test_example_retries_on_b_and_leaves_a_isolated(ex: Example, detour: str) -> None:
    _check_delivered_and_isolated(ex, _run(ex, detour), detour, {})


def _check_delivered_and_isolated(ex: Example, out: subprocess.CompletedProcess[str], url: str,
                                  headers: dict[str, str]) -> None:
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

    table = httpx.get(url + "/fault-items", headers=headers, timeout=5).json()
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


@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("ex", _params())
def test_example_sends_detour_token(ex: Example, secured: Secured) -> None:
    """``DETOUR_TOKEN`` goes with every call: refused without it, served with an admin one."""
    admin = {"Authorization": f"Bearer {secured.admin}"}
    route = f"{secured.url}/routes/example-{ex.lang}"
    refused = {None: "HTTP 401", "": "HTTP 401", secured.producer: "HTTP 403"}
    for token, status in refused.items():
        out = _run(ex, secured.url, token)
        log = f"token {token!r}: exit {out.returncode}\nstdout:\n{out.stdout}\n" \
              f"stderr:\n{out.stderr}"
        # Unset and empty both mean no header (401); a producer may not register a route (403).
        assert out.returncode == 2, log
        assert "cannot register the route" in out.stdout and status in out.stdout, log
        assert httpx.get(route, headers=admin, timeout=5).status_code == 404, log

    out = _run(ex, secured.url, secured.admin)
    _check_delivered_and_isolated(ex, out, secured.url, admin)
    assert httpx.get(route, headers=admin, timeout=5).status_code == 200
