"""Service processes forked from one that has imported the service already.

Why: the suite starts a real ``python -m service`` more than a hundred times, and each one
spends about 1.5 s of CPU importing FastAPI, pydantic, uvicorn and the service before it
serves (``python -X importtime -c "import service.app"``). On two cores that is minutes of
a run. Each test worker keeps one *fork server*: a single-threaded process that imports
the service once and forks a fresh process for each start. The child is a real service
process like any other (its own pid, session, environment, arguments, log, sockets and
exit code); only the imports are inherited instead of repeated, the way a pre-forking
server or ``multiprocessing``'s forkserver does it.

What a forked start cannot reproduce falls back to ``exec`` (``ServiceProcess`` decides):
more than one uvicorn worker (uvicorn spawns them through ``multiprocessing``, which
would re-import the fork server's ``__main__``), and any environment that is read when a
module is imported or the interpreter starts (``PYTHON*``, ``PROMETHEUS_MULTIPROC_DIR``,
the locale). The suite turns it on (``TESTS_FORK_SERVICES=1``, set by ``conftest.py``);
``TESTS_FORK_SERVICES=0 make test`` execs every service. The benchmarks, which share the
process helpers, leave it off: what they measure of a service (its memory, its start) is an
exec'd one's.

The protocol is one JSON object per line each way, over the fork server's stdin and
stdout: ``spawn`` answers the child's pid, ``status`` its exit code once it has ended
(``None`` while it runs; the fork server reaps its children). The test side holds each
child through a pidfd, so waiting needs no round trip and a signal can never reach a
recycled pid.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: Environment a child cannot take over from the fork server: read at interpreter start or
#: at import, before the fork. A start whose environment differs in one of these is exec'd.
_READ_AT_IMPORT = ("PYTHON", "PROMETHEUS_MULTIPROC_DIR", "LANG", "LC_")

#: Exit codes of children nobody has asked for yet; bounded (the oldest go first).
_MAX_STATUSES = 1024


# --- the fork server (its own process) --------------------------------------------------


def _preload() -> None:
    """Import what ``python -m service`` imports before it serves a request."""
    import uvicorn.lifespan.on  # noqa: F401
    import uvicorn.loops.auto  # noqa: F401
    import uvicorn.loops.uvloop  # noqa: F401
    import uvicorn.server  # noqa: F401

    import service.__main__  # noqa: F401  (flags, settings, auth, store connections)
    import service.app  # noqa: F401  (the app factory and every route)
    import service.edge.protocol  # noqa: F401  (the HTTP protocol uvicorn is given)


def _child(request: dict[str, Any], proto: tuple[int, int]) -> None:
    """Become ``python -m service <args>``; never returns."""
    code = 1
    try:
        os.setsid()
        for fd in proto:
            os.close(fd)
        log = os.open(request["log"] or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        time.tzset()
        import service.__main__ as entry

        sys.argv = [entry.__file__, *request["args"]]
        try:
            code = entry.main(request["args"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
        # What the interpreter does on its way out: join the threads left, run the exit
        # handlers (logging's flush among them), flush the streams.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - the child reports any failure by its exit code
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve() -> None:
    """The fork server's loop: answer requests, reap children, until stdin closes."""
    # Requests and answers on their own descriptors; 0 and 1 are not the protocol's, so
    # nothing the preloaded modules print can corrupt it.
    proto_in, proto_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    os.close(null)
    _preload()
    statuses: dict[int, int] = {}
    children: set[int] = set()

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            statuses[pid] = os.waitstatus_to_exitcode(status)
            while len(statuses) > _MAX_STATUSES:
                del statuses[next(iter(statuses))]

    def answer(obj: object) -> None:
        os.write(proto_out, (json.dumps(obj) + "\n").encode())

    answer({"ready": os.getpid()})
    buffered = b""
    while True:
        readable, _, _ = select.select([proto_in], [], [], 0.05)
        reap()
        if not readable:
            continue
        chunk = os.read(proto_in, 65536)
        if not chunk:
            break
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            request = json.loads(line)
            if request["op"] == "spawn":
                if threading.active_count() != 1:
                    answer({"error": "the fork server has threads; it cannot fork safely"})
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, (proto_in, proto_out))
                children.add(pid)
                answer({"pid": pid})
            elif request["op"] == "status":
                reap()
                answer({"code": statuses.pop(request["pid"], None)})
    # The test worker has gone: end what it left running, so nothing outlives the run.
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    for pid in children:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


# --- the test side -----------------------------------------------------------------------


class ForkServer:
    """The test worker's handle on its fork server; thread-safe."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver"], cwd=ROOT, env=self.env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
        )
        self._lock = threading.Lock()
        self._buffered = b""
        first = self._read(60)  # imports take seconds on a busy machine
        if "ready" not in first:
            raise RuntimeError(f"the fork server did not start: {first}")

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffered:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"the fork server did not answer within {timeout_s} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the fork server exited")
            self._buffered += chunk
        line, self._buffered = self._buffered.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, request: dict[str, Any], timeout_s: float = 30) -> dict[str, Any]:
        with self._lock:
            assert self._proc.stdin is not None
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
            return self._read(timeout_s)

    def takes(self, env: dict[str, str]) -> bool:
        """Whether a child with ``env`` behaves as if it had been exec'd with it."""
        return all(
            env.get(name) == self.env.get(name)
            for name in {*env, *self.env}
            if name.startswith(_READ_AT_IMPORT)
        )

    def spawn(self, args: list[str], env: dict[str, str], log: Path | None) -> Forked:
        answer = self.ask({"op": "spawn", "args": args, "env": env, "cwd": str(ROOT),
                           "log": str(log) if log else None})
        if "pid" not in answer:
            raise RuntimeError(answer.get("error", answer))
        return Forked(self, int(answer["pid"]), args)

    def close(self) -> None:
        """Close its stdin: it kills what it still runs, reaps it and exits."""
        with self._lock:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
            self._proc.stdout.close()


class Forked:
    """A forked service, with the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._server = server
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # ended and reaped already: its code is waiting
            self._pidfd = None

    def __del__(self) -> None:
        if getattr(self, "_pidfd", None) is not None:
            os.close(self._pidfd)  # type: ignore[arg-type]

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self._server.ask({"op": "status", "pid": self.pid})["code"]
            if code is not None:
                self.returncode = int(code)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            if self._pidfd is not None:
                # Readable once the process has ended; the next poll's answer then reaps it.
                if select.select([self._pidfd], [], [], min(left or 1.0, 1.0))[0] and \
                        self.poll() is None:
                    time.sleep(0.001)  # not reaped yet: do not spin
            else:
                time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_server: ForkServer | None = None
_server_lock = threading.Lock()


def fork_server() -> ForkServer | None:
    """This process's fork server, started on first use; None unless turned on."""
    global _server
    if os.environ.get("TESTS_FORK_SERVICES") != "1":
        return None
    with _server_lock:
        if _server is None:
            _server = ForkServer()
            atexit.register(_server.close)
        return _server


if __name__ == "__main__":
    _serve()
