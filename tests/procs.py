"""Real processes for tests and benchmarks: redis-server and Detour on free loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

import httpx
import redis

from tests.forkserver import Forked, ForkServer, fork_server

ROOT = Path(__file__).resolve().parents[1]

#: Detour's per-report Redis timeout (``redis_call_timeout_s``) for tests that are not about
#: it. The 50 ms default fires now and then on a busy machine: the report then goes to the
#: journal and is answered degraded and replayed later, which such a test would take for a
#: failure. Tests that need the fallback cause it on purpose (a killed, stopped or paused
#: Redis) and keep the default.
PATIENT_CALL_TIMEOUT_S = 5.0
#: The same for a Detour process.
PATIENT_ENV = {"DETOUR_REDIS_CALL_TIMEOUT_S": str(PATIENT_CALL_TIMEOUT_S)}


def write_tokens(path: Path, tokens: dict[str, tuple[str, str, str]]) -> Path:
    """A tokens file for ``DETOUR_TOKENS_FILE``: {name: (token, role, namespace)}, hashed."""
    from service.auth import hash_token

    path.write_text(json.dumps({"tokens": [
        {"name": name, "sha256": hash_token(token), "role": role, "namespace": ns}
        for name, (token, role, ns) in tokens.items()
    ]}))
    return path


def end_process(proc: subprocess.Popen[Any], timeout_s: float = 10) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; always reaped."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


#: The nice value of processes a test runs ahead of the machine (``ahead_of_the_machine``).
NICE_AHEAD = -10


def ahead_of_the_machine(pid: int) -> None:
    """Every thread of ``pid`` at ``NICE_AHEAD``, as a pod with a CPU request runs against
    the best-effort load beside it. Where a test drives a replica as hard as its core allows
    and judges its fairness (one client's load against another tenant's latency or
    refusals), what it measures is the replica's own queueing; at nice 0 the rest of a busy
    machine (the other test workers, a CPU hog) decides instead when the replica runs
    (tests/README.md has the failures that showed it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.setpriority(os.PRIO_PROCESS, int(tid), NICE_AHEAD)


@contextlib.contextmanager
def starting_ahead_of_the_machine() -> Iterator[None]:
    """The calling thread at ``NICE_AHEAD`` meanwhile, so that the processes it starts (which
    inherit its nice value) run ahead of the machine: for a test whose judgement needs its
    processes at their own pace, such as producers sending at a fixed rate."""
    fork_server()  # started (once per worker) before: the services it forks keep nice 0
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, NICE_AHEAD)
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: object, timeout_s: float, what: str, interval_s: float = 0.01) -> None:
    """Poll ``check()`` until true; a bounded wait for a process to come up."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
            last = exc
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not ready after {timeout_s}s (last error: {last!r})")


async def wait_until_async(check: object, timeout_s: float, what: str,
                           interval_s: float = 0.01) -> None:
    """``wait_until`` for a test whose event loop must keep running meanwhile (a store's
    sync task, a client's stream): ``check()`` is polled between awaits."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
            last = exc
        await asyncio.sleep(interval_s)
    raise TimeoutError(f"{what} not seen after {timeout_s}s (last error: {last!r})")


def listening_inodes(port: int) -> set[str]:
    """The inodes of the sockets listening on TCP ``port``, any address
    (``/proc/net/tcp`` and ``tcp6``)."""
    want = f":{port:04X}"
    inodes = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(name) as table:
            for line in list(table)[1:]:
                fields = line.split()
                if fields[1].endswith(want) and fields[3] == "0A":  # LISTEN
                    inodes.add(fields[9])
    return inodes


def holds_listener(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on ``port``."""
    sockets = {f"socket:[{inode}]" for inode in listening_inodes(port)}
    if not sockets:
        return False
    fds = Path(f"/proc/{pid}/fd")
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd) in sockets:
                return True
    return False


#: How many ports a server tries before giving up: each is free when chosen, but another
#: worker's server may bind it before this one does (rare, and never five times in a row).
PORT_TRIES = 5

T = TypeVar("T")


def on_a_free_port(start: Callable[[int], T | None], what: str,
                   port: int | None = None) -> tuple[T, int]:
    """``start(port)``, on ``port`` or else on a free one; returns what it started and where.

    ``start`` returns None when its process exited before it was up. When another process
    listens on that port now (it took the port after ``free_port`` chose it), this starts
    again on another; any other failure, or a port asked for, is an error at once.
    """
    for _ in range(PORT_TRIES):
        chosen = port or free_port()
        started = start(chosen)
        if started is not None:
            return started, chosen
        taken = bool(listening_inodes(chosen))
        if port is not None or not taken:
            raise RuntimeError(f"{what} exited at start on {chosen}"
                               + (" (another process's port)" if taken else ""))
    raise RuntimeError(f"{what} found no free port in {PORT_TRIES} tries")


def start_redis_process(args: Sequence[str], port: int, what: str,
                        stdout: Any = subprocess.DEVNULL) -> subprocess.Popen[bytes] | None:
    """Start a redis-server (or sentinel) that listens on ``port``; None when it exited
    before it was up, its port taken meanwhile.

    Up means that this process holds the socket listening on the port, and the port answers
    a PING (no command of a server whose ACL allows less): a port taken by another worker's
    server answers a PING too, and a test would then talk to someone else's server.
    """
    proc = subprocess.Popen(list(args), stdout=stdout, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)

    def ours() -> bool:
        if proc.poll() is not None:
            return True  # exited: stop waiting
        return holds_listener(proc.pid, port) and bool(client.ping())

    try:
        wait_until(ours, 10, f"{what} on {port}")
    except BaseException:
        end_process(proc)
        raise
    finally:
        client.close()
    return proc if proc.poll() is None else None


def start_sentinel(workdir: Path, config: str) -> tuple[subprocess.Popen[bytes], int]:
    """A ``redis-sentinel`` on a free loopback port, ``config`` its monitor lines; returns
    the process and its port."""
    binary = shutil.which("redis-sentinel")
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError("redis-server not found: run `make test` (it installs it)")

    def start(port: int) -> subprocess.Popen[bytes] | None:
        conf = workdir / f"sentinel-{port}.conf"
        conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {workdir}\n{config}")
        # redis-sentinel is redis-server started as a sentinel (same binary).
        args = [binary, str(conf)] if binary else [server, str(conf), "--sentinel"]
        return start_redis_process(args, port, "redis-sentinel")

    return on_a_free_port(start, "redis-sentinel")


class RedisServer:
    """A throwaway ``redis-server`` with no persistence, on a free port."""

    def __init__(self, port: int | None = None, extra: Sequence[str] = (),
                 persistent: bool = False, data_dir: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: run `make test` (it installs it)")
        self._held: socket.socket | None = None  # kill_holding_port's
        self._frozen = False  # freeze's: stop thaws first, so the server can exit cleanly
        self.dir = data_dir or tempfile.mkdtemp(prefix="detour-redis-")
        # persistent: every write fsynced to the AOF before Redis answers, so a
        # SIGKILL loses nothing that was acknowledged.
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if persistent \
            else ["--appendonly", "no"]
        try:
            self.proc, self.port = on_a_free_port(lambda p: start_redis_process(
                [binary, "--port", str(p), "--bind", "127.0.0.1", "--save", "", *aof,
                 "--dir", self.dir, "--protected-mode", "yes", *extra], p, "redis-server"),
                "redis-server", port)
        except BaseException:
            if data_dir is None:  # ours, and no server will use it
                shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2,
                           decode_responses=True)

    def kill(self) -> None:
        """SIGKILL, keeping the data directory (a crash)."""
        self.proc.kill()
        self.proc.wait(10)

    def freeze(self) -> None:
        """SIGSTOP: commands sent meanwhile wait in the socket and run at ``thaw``, after
        their callers may have given up on them (a server that runs a call late)."""
        self.proc.send_signal(signal.SIGSTOP)
        self._frozen = True

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self._frozen = False

    def kill_holding_port(self) -> None:
        """``kill``, then keep the port bound, not listening, until ``stop``: a connect is
        refused as by a dead server, but no other server of the suite (another worker's) can
        take the port while a sentinel still knows it as its old master, and would make
        whatever answers there a replica of its new one."""
        self.kill()
        held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            held.bind(("127.0.0.1", self.port))
        except OSError:  # taken in the instant since the kill: nothing left to hold
            held.close()
            return
        self._held = held

    def stop(self) -> None:
        if self._frozen and self.proc.poll() is None:
            self.thaw()
        end_process(self.proc)
        if self._held is not None:
            self._held.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class ProcessExited(RuntimeError):
    """A server exited before it was up."""


class HttpProcess:
    """A server in its own process group on a free loopback port, ready when ``ready_path``
    (``/readyz``) answers 200 and the socket listening on the port is this process's: a
    port another worker's server took answers too."""

    def __init__(self, what: str, args: list[str], port: int, env: dict[str, str] | None,
                 log_path: Path | None, ready_path: str = "/readyz",
                 forked_from: ForkServer | None = None) -> None:
        """``forked_from``: a fork server whose preloaded process runs ``args[3:]`` as
        ``python -m service`` (tests/forkserver.py); None execs ``args``."""
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, **(env or {})}
        self._log: Any = subprocess.DEVNULL
        self.proc: subprocess.Popen[bytes] | Forked
        if forked_from is not None:
            assert args[:3] == [sys.executable, "-m", "service"], args
            self.proc = forked_from.spawn(args[3:], full_env, log_path)
        else:
            self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
            self.proc = subprocess.Popen(args, cwd=ROOT, env=full_env, stdout=self._log,
                                         stderr=self._log, start_new_session=True)

        def ready() -> bool:
            if self.proc.poll() is not None:
                return True  # exited: stop waiting
            return holds_listener(self.proc.pid, self.port) and \
                httpx.get(self.url + ready_path, timeout=1).status_code == 200

        try:
            # Generous: imports alone take seconds on a busy machine.
            wait_until(ready, 60, f"{what} on {self.port}", interval_s=0.05)
            if self.proc.poll() is not None:
                raise ProcessExited(f"{what} exited with {self.proc.returncode}")
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if hasattr(self._log, "close"):
            self._log.close()


class ServiceProcess(HttpProcess):
    """``python -m service`` as its own process."""

    def __init__(self, redis_url: str | None = None, workers: int = 1,
                 env: dict[str, str] | None = None, log_path: Path | None = None,
                 port: int | None = None) -> None:
        # ``port``: restart a stopped service where its clients expect it.
        # Forked from a process that has imported the service already, when the fork can
        # stand for an exec (tests/forkserver.py says when it cannot).
        forking = fork_server() if workers == 1 else None
        if forking is not None and not forking.takes({**os.environ, **(env or {})}):
            forking = None

        def start(p: int) -> ServiceProcess | None:
            args = [sys.executable, "-m", "service", "--port", str(p), "--log-level",
                    "info", "--workers", str(workers)]
            if redis_url:
                args += ["--redis-url", redis_url]
            try:
                HttpProcess.__init__(self, "detour", args, p, env, log_path,
                                     forked_from=forking)
            except ProcessExited:
                if listening_inodes(p):
                    return None  # the port was taken: try another
                raise  # a failure of its own: say how it exited
            return self

        on_a_free_port(start, "detour", port)
