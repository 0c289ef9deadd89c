"""The suite's fork server (tests/forkserver.py): a forked service is a service like an exec'd one.

The suite forks its service processes from one that has imported the service already. That
is only honest if the child is what ``python -m service`` would have been: its own process
and session, the environment and arguments it was given, its log, its exit code however it
ends, and nothing of it left when the suite is gone. Where a fork cannot stand for an exec
(environment read at interpreter start or import), the helpers exec.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests import forkserver
from tests.forkserver import ForkServer
from tests.procs import ServiceProcess, free_port, wait_until, write_tokens

pytestmark = pytest.mark.integration


@pytest.fixture
def server() -> Iterator[ForkServer]:
    """A fork server of the test's own (not the worker's shared one)."""
    fs = ForkServer()
    yield fs
    fs.close()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_services_are_forked_unless_turned_off() -> None:
    """conftest.py turns the fork server on: a service's parent is the worker's fork server.
    ``TESTS_FORK_SERVICES=0`` execs it instead: its parent is this process."""
    shared = forkserver.fork_server()
    assert (shared is not None) == (os.environ.get("TESTS_FORK_SERVICES") == "1")
    with ServiceProcess() as svc:
        parent = shared._proc.pid if shared is not None else os.getpid()
        assert _parent(svc.proc.pid) == parent
        assert os.getsid(svc.proc.pid) == svc.proc.pid  # its own session either way
        assert httpx.get(svc.url + "/readyz", timeout=5).status_code == 200


def _ready(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200


def test_a_forked_service_takes_its_environment_and_arguments(server: ForkServer,
                                                              tmp_path: Path) -> None:
    """A setting given only in the start's environment (a tokens file) is in force, and
    one given only as an argument (the port) too: nothing of the fork server's stands."""
    tokens = write_tokens(tmp_path / "tokens.json", {"p": ("s3cret", "producer", "a")})
    for env, refused in (({"DETOUR_TOKENS_FILE": str(tokens)}, True),
                         ({}, False)):  # the next fork does not inherit the last one's env
        port = free_port()
        child = server.spawn(["--port", str(port)], {**os.environ, **env}, None)
        try:
            wait_until(partial(_ready, port), 30, "forked service")
            answer = httpx.post(f"http://127.0.0.1:{port}/select", json={"topic": "t"},
                                timeout=5)
            assert (answer.status_code == 401) == refused, answer.text
        finally:
            child.terminate()
            child.wait(30)


def test_a_forked_start_that_fails_exits_as_an_exec_would(server: ForkServer,
                                                           tmp_path: Path) -> None:
    """Same exit code and message on stderr (the log) both ways."""
    env = {**os.environ, "DETOUR_TOKENS_FILE": str(tmp_path / "missing.json")}
    args = ["--port", str(free_port())]
    log = tmp_path / "forked.log"
    forked = server.spawn(args, env, log)
    code = forked.wait(30)
    execd = subprocess.run([sys.executable, "-m", "service", *args], env=env,
                           capture_output=True, timeout=60, cwd=forkserver.ROOT)
    assert code == execd.returncode == 2
    assert log.read_text().startswith("detour: ")
    assert log.read_text() == execd.stderr.decode()


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGKILL, -signal.SIGKILL),
                                           (signal.SIGTERM, 0)])
def test_a_forked_service_ends_with_the_code_of_how_it_was_stopped(
        server: ForkServer, sig: int, code: int) -> None:
    """Killed: minus the signal, as Popen says it. Terminated: uvicorn's clean stop, 0."""
    port = free_port()
    child = server.spawn(["--port", str(port)], {**os.environ}, None)
    wait_until(lambda: child.poll() is not None or _ready(port), 30, "forked service")
    assert child.poll() is None
    child.send_signal(sig)
    assert child.wait(30) == code
    assert child.poll() == code  # asked again: the same answer, not a second reap


def test_a_start_whose_interpreter_settings_differ_is_execd() -> None:
    """PYTHONHASHSEED is read when the interpreter starts: a fork would keep the fork
    server's, so that start is exec'd (its parent is this process)."""
    with ServiceProcess(env={"PYTHONHASHSEED": "7"}) as svc:
        assert not isinstance(svc.proc, forkserver.Forked)
        assert _parent(svc.proc.pid) == os.getpid()
        assert Path(f"/proc/{svc.proc.pid}/environ").read_bytes().split(b"\0").count(
            b"PYTHONHASHSEED=7") == 1


def test_nothing_a_fork_server_started_outlives_it(tmp_path: Path) -> None:
    """A test worker that ends (or crashes) closes its fork server's stdin: what it left
    running is killed with it, not left serving a port after the run."""
    fs = ForkServer()
    port = free_port()
    child = fs.spawn(["--port", str(port)], {**os.environ}, None)
    wait_until(partial(_ready, port), 30, "forked service")
    pid = child.pid
    fs.close()
    assert fs._proc.returncode == 0
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped before the server ended
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
