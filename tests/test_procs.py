"""The suite's own process helpers (tests/procs.py): a server that finds its port taken.

A port is free when ``free_port`` chooses it, but another worker's server may bind it before
the server it was chosen for does. That server then exits, and a readiness check that only
asks the port would be answered by the other worker's server: the test would run against
someone else's data. The helpers start again on another port, and call a server up only
when the process listening on its port is theirs (the socket it holds, from ``/proc``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests import procs
from tests.procs import RedisServer, ServiceProcess, holds_listener, start_sentinel

pytestmark = pytest.mark.integration


@pytest.fixture
def taken() -> Iterator[RedisServer]:
    """A server already on the port the next ``free_port`` will name (another worker's)."""
    other = RedisServer()
    with other.client() as c:
        c.set("theirs", "1")
    yield other
    other.stop()


@pytest.fixture
def made_dirs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The data directories RedisServer makes, so a test can check that one whose server
    never started is not left behind."""
    made: list[str] = []
    real = procs.tempfile.mkdtemp

    def recording(*args: object, **kwargs: object) -> str:
        made.append(real(*args, **kwargs))  # type: ignore[call-overload]
        return made[-1]

    monkeypatch.setattr(procs.tempfile, "mkdtemp", recording)
    return made


def _first_port_taken(monkeypatch: pytest.MonkeyPatch, port: int) -> list[int]:
    """``free_port`` names ``port`` first, then free ones; returns the ports it named."""
    named: list[int] = []
    real = procs.free_port

    def racing() -> int:
        named.append(port if not named else real())
        return named[-1]

    monkeypatch.setattr(procs, "free_port", racing)
    return named


def test_a_redis_server_whose_port_was_taken_starts_on_another(
    taken: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    named = _first_port_taken(monkeypatch, taken.port)
    mine = RedisServer()
    try:
        assert named[0] == taken.port and len(named) == 2
        assert mine.port == named[1] != taken.port
        with mine.client() as c:
            assert int(c.info("server")["process_id"]) == mine.proc.pid
            assert c.get("theirs") is None
        with taken.client() as c:
            assert c.get("theirs") == "1"  # the other server is left alone
    finally:
        mine.stop()


def test_a_redis_server_asked_for_a_taken_port_says_so(taken: RedisServer,
                                                       made_dirs: list[str]) -> None:
    with pytest.raises(RuntimeError, match=f"on {taken.port} \\(another process's port\\)"):
        RedisServer(port=taken.port)
    assert len(made_dirs) == 1 and not Path(made_dirs[0]).exists()  # its directory went too


def test_a_redis_server_that_fails_for_another_reason_is_not_retried(
    monkeypatch: pytest.MonkeyPatch, made_dirs: list[str]
) -> None:
    named = _first_port_taken(monkeypatch, procs.free_port())  # a free port, not taken
    with pytest.raises(RuntimeError, match="exited at start") as raised:
        RedisServer(extra=["--no-such-option", "1"])
    assert len(named) == 1 and "another process" not in str(raised.value)
    assert len(made_dirs) == 1 and not Path(made_dirs[0]).exists()


def test_a_sentinel_whose_port_was_taken_starts_on_another(
    taken: RedisServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    named = _first_port_taken(monkeypatch, taken.port)
    proc, port = start_sentinel(
        tmp_path, f"sentinel monitor m-{taken.port} 127.0.0.1 {taken.port} 1\n")
    try:
        assert named[0] == taken.port and port == named[1] != taken.port
        with redis.Redis(port=port, socket_timeout=2, decode_responses=True) as s:
            assert int(s.info("server")["process_id"]) == proc.pid
            assert s.sentinel_master(f"m-{taken.port}")["port"] == taken.port
    finally:
        procs.end_process(proc)


def test_every_try_taken_is_an_error_not_a_hang(
    taken: RedisServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(procs, "free_port", lambda: taken.port)
    with pytest.raises(RuntimeError, match=f"no free port in {procs.PORT_TRIES} tries"):
        start_sentinel(tmp_path, f"sentinel monitor m 127.0.0.1 {taken.port} 1\n")


def test_a_service_whose_port_was_taken_starts_on_another(
    taken: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port answers, but not as Detour: the service exits (address in use), and the
    helper starts it again on a free port instead of waiting out its readiness bound."""
    named = _first_port_taken(monkeypatch, taken.port)
    with ServiceProcess() as svc:
        assert named[0] == taken.port and svc.port == named[1] != taken.port
        assert holds_listener(svc.proc.pid, svc.port)
        assert not holds_listener(svc.proc.pid, taken.port)
        assert httpx.get(svc.url + "/readyz", timeout=5).status_code == 200


def test_a_service_that_fails_for_another_reason_says_how_it_exited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    named = _first_port_taken(monkeypatch, procs.free_port())  # a free port, not taken
    with pytest.raises(procs.ProcessExited, match="detour exited with [1-9]"):
        ServiceProcess(env={"DETOUR_PROFILE": "no-such-profile"})
    assert len(named) == 1  # not retried on another port


def test_a_service_asked_for_a_taken_port_says_so(taken: RedisServer) -> None:
    with pytest.raises(RuntimeError, match=f"on {taken.port} \\(another process's port\\)"):
        ServiceProcess(port=taken.port)


def _nice_of_a_child() -> int:
    out = subprocess.run([sys.executable, "-c", "import os; print(os.nice(0))"],
                         capture_output=True, text=True, timeout=30, check=True)
    return int(out.stdout)


def test_processes_started_ahead_of_the_machine_run_ahead_and_nothing_else_does() -> None:
    """``starting_ahead_of_the_machine``: what the block starts inherits ``NICE_AHEAD``; the
    worker's thread is back at its nice value after it, and a service started in the block
    through the worker's fork server keeps the fork server's (0)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with procs.starting_ahead_of_the_machine():
        assert _nice_of_a_child() == procs.NICE_AHEAD
        with ServiceProcess() as svc:
            forked = procs.fork_server() is not None
            nice = os.getpriority(os.PRIO_PROCESS, svc.proc.pid)
    assert nice == (before if forked else procs.NICE_AHEAD)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
    assert _nice_of_a_child() == before
    with ServiceProcess() as svc:
        procs.ahead_of_the_machine(svc.proc.pid)
        tids = os.listdir(f"/proc/{svc.proc.pid}/task")
        assert tids and all(os.getpriority(os.PRIO_PROCESS, int(t)) == procs.NICE_AHEAD
                            for t in tids)
