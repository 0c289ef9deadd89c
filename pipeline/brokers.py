"""Stand-in brokers that fail for real: one ``redis-server`` process per broker, faults by signal.

Why real processes: RocketMQ cannot be installed here, and a broker that is
"down" because a flag says so proves nothing about timeouts, refused
connections or a client's socket state. Each broker is a ``redis-server`` on a
free loopback port and each of its queues a Redis stream (``XADD <topic>:<queueId>``).
The faults are what a broker host really does:

    stop     SIGSTOP: a hung broker; the kernel still accepts bytes, sends time out
    cont     SIGCONT: it wakes and applies what was queued (duplicates, at-least-once)
    kill     SIGKILL: a crashed broker; connections are refused
    restart  start it again on the same port (its data comes back from the AOF)
    pause    CLIENT PAUSE <hold> WRITE: every write waits (added latency)
    sleep    DEBUG SLEEP <hold>: the whole server blocks (a GC-like stall)

Durability: RDB snapshots are off (``--save ""``) but the append-only file is on
(``appendfsync no``), so a SIGKILLed broker keeps what it acknowledged, as a RocketMQ
broker keeps its commit log when the process dies: the write reaches the kernel before
the reply leaves, and a process kill does not lose the kernel's page cache. Not
``everysec``: while a background fsync is slow (a busy disk), Redis then postpones the
file write by up to 2 s and still replies, so a kill loses acknowledged messages. With
``persist=False`` (``--no-persist``) a broker runs ``--appendonly no`` and a kill loses
its messages for real.

A fault spec is ``ACTION:BROKER@WHEN[+HOLD]``: WHEN is ``5000r`` (once the
fleet holds 5,000 messages) or ``2.5s`` (after the schedule starts); HOLD is
seconds: how long a stop lasts before SIGCONT, a kill before the restart, a
pause or a sleep. ``kill:broker-b@5000r+4`` crashes broker-b at 5,000 messages
and restarts it 4 s later.

CLI::

    python -m pipeline.brokers start --n 4 --detour http://127.0.0.1:8080 --topic orders \\
        [--queues 4] [--fault kill:broker-b@5000r+4 ...] [--no-persist]

prints the fleet as JSON, registers it as the topic's route in Detour, drops
the fault items Detour holds for its broker names (an earlier fleet's; not with
``--keep-faults``), runs the fault schedule and stays up until Ctrl-C (or
``--for`` seconds). Registering a route and dropping fault items are admin
calls: a Detour with tokens needs an admin token in ``DETOUR_TOKEN`` (or
``--token``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Literal

import httpx
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipeline import add_token_argument, auth_headers, detour_token

Action = Literal["stop", "cont", "kill", "restart", "pause", "sleep"]
ACTIONS: tuple[str, ...] = ("stop", "cont", "kill", "restart", "pause", "sleep")
State = Literal["up", "stopped", "down"]


def free_port() -> int:
    """A port nothing listens on now (bound to 127.0.0.1 and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def no_retry() -> Retry:
    """redis-py retries 10 times by default; a broker client must see every failure once."""
    return Retry(NoBackoff(), 0)


def stream_key(topic: str, queue_id: int) -> str:
    """The stream that stands for queue ``queue_id`` of ``topic`` on a broker."""
    return f"{topic}:{queue_id}"


def broker_names(n: int) -> list[str]:
    """``broker-a`` ... ``broker-z``, or ``broker-000`` ... past 26: sorted as Detour orders."""
    if n <= 26:
        return [f"broker-{c}" for c in string.ascii_lowercase[:n]]
    return [f"broker-{i:03d}" for i in range(n)]


class Broker:
    """One stand-in broker: a ``redis-server`` process on a fixed loopback port."""

    def __init__(
        self, name: str, queues: int, root: Path, port: int | None = None, persist: bool = True
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found (apt-get install redis-server)")
        self.binary = binary
        self.name = name
        self.queues = queues
        self.port = port or free_port()
        self.persist = persist
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.state: State = "down"
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def _args(self) -> list[str]:
        durability = (
            ["--appendonly", "yes", "--appendfsync", "no"]
            if self.persist
            else ["--appendonly", "no"]
        )
        return [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", *durability, "--dir", str(self.dir),
            "--protected-mode", "yes", "--enable-debug-command", "local",
            "--supervised", "systemd",
            "--logfile", str(self.dir / "redis.log"),
        ]

    def client(self, timeout_s: float = 2.0) -> redis.Redis:
        """An admin client (one try per command, ``timeout_s`` per call)."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry=no_retry(), decode_responses=True,
        )

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the process (again, on the same port and data dir); return once it is ready.

        Ready is an event, not a poll: redis-server runs ``--supervised systemd``
        and sends ``READY=1`` to our ``NOTIFY_SOCKET`` once it accepts connections
        (after loading its AOF). A build without systemd support falls back to PING.
        """
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running")
        sock_path = Path(tempfile.mkdtemp(prefix="detour-notify-")) / "n"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            notify.bind(str(sock_path))
            self.proc = subprocess.Popen(
                self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={**os.environ, "NOTIFY_SOCKET": str(sock_path)},
            )
            self.starts += 1
            try:
                ready = self._await_ready(notify, time.monotonic() + timeout_s)
            finally:
                shutil.rmtree(sock_path.parent, ignore_errors=True)
        if not ready:
            with self.client(1.0) as c:
                try:
                    c.ping()
                except redis.RedisError as exc:
                    raise TimeoutError(
                        f"{self.name} on {self.port} not ready after {timeout_s}s"
                    ) from exc
        self.state = "up"

    def _await_ready(self, notify: socket.socket, deadline: float) -> bool:
        assert self.proc is not None
        while (left := deadline - time.monotonic()) > 0:
            notify.settimeout(min(left, 0.5))
            try:
                message = notify.recv(4096)
            except TimeoutError:
                message = b""
            if b"READY=1" in message:
                return True
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
        return False

    def stop(self) -> None:
        """SIGSTOP: the process hangs; its sockets still accept bytes nobody reads."""
        self._signal(signal.SIGSTOP)
        self.state = "stopped"

    def cont(self) -> None:
        """SIGCONT: the hung process goes on, applying whatever was queued meanwhile."""
        self._signal(signal.SIGCONT)
        self.state = "up"

    def kill(self) -> None:
        """SIGKILL: a crash; the port refuses connections until ``restart``."""
        if self.proc is None or self.proc.poll() is not None:
            self.state = "down"
            return
        self._signal(signal.SIGKILL)
        self.proc.wait(10)
        self.state = "down"

    def restart(self) -> None:
        """Kill if still running, then start on the same port with the same data dir."""
        self.kill()
        self.start()

    def pause(self, seconds: float) -> None:
        """CLIENT PAUSE WRITE: every write waits until ``seconds`` have passed."""
        with self.client() as c:
            c.execute_command("CLIENT", "PAUSE", max(1, int(seconds * 1000)), "WRITE")

    def sleep(self, seconds: float) -> threading.Thread:
        """DEBUG SLEEP: the server blocks for ``seconds`` (the call returns after it)."""

        def run() -> None:
            try:
                with self.client(seconds + 5.0) as c:
                    c.execute_command("DEBUG", "SLEEP", f"{seconds:.3f}")
            except redis.RedisError:
                pass  # killed or stopped meanwhile: the fault still happened

        t = threading.Thread(target=run, name=f"sleep-{self.name}", daemon=True)
        t.start()
        return t

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} is not running")
        os.kill(self.proc.pid, sig)

    def messages(self, topic: str, timeout_s: float = 0.5) -> int:
        """Messages on this broker's streams for ``topic`` (raises when it does not answer)."""
        with self.client(timeout_s) as c:
            pipe = c.pipeline(transaction=False)
            for q in range(self.queues):
                pipe.xlen(stream_key(topic, q))
            return sum(int(x) for x in pipe.execute())

    def close(self) -> None:
        """End the process whatever its state (a stopped one is continued first)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.state = "down"

    def describe(self) -> dict[str, Any]:
        return {
            "brokerName": self.name, "address": self.address, "port": self.port,
            "pid": self.pid, "writeQueueNums": self.queues, "state": self.state,
            "persist": self.persist,
        }


# -- fault schedule -------------------------------------------------------------------------

_SPEC = re.compile(
    r"^(?P<action>[a-z]+):(?P<broker>[A-Za-z0-9_.%|-]+)@(?P<when>\d+(?:\.\d+)?)(?P<unit>[rs])"
    r"(?:\+(?P<hold>\d+(?:\.\d+)?))?$"
)


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: ``action`` on ``broker`` once ``records`` messages are on the
    fleet or ``at_s`` seconds have passed; ``hold_s`` is its length (see the module doc)."""

    action: Action
    broker: str
    records: int | None = None
    at_s: float | None = None
    hold_s: float | None = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; one of {ACTIONS}")
        if (self.records is None) == (self.at_s is None):
            raise ValueError("a fault needs exactly one trigger: records or at_s")
        if self.action in ("pause", "sleep") and not self.hold_s:
            raise ValueError(f"{self.action} needs a hold in seconds (+HOLD)")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``ACTION:BROKER@WHEN[+HOLD]``: ``kill:broker-b@5000r+4``, ``stop:broker-c@3s+5``."""
        m = _SPEC.match(text.strip())
        if m is None:
            raise ValueError(f"bad fault spec {text!r}: want ACTION:BROKER@<n>r|<s>s[+HOLD]")
        hold = float(m["hold"]) if m["hold"] else None
        if m["unit"] == "r":
            return cls(m["action"], m["broker"], records=int(float(m["when"])), hold_s=hold)  # type: ignore[arg-type]
        return cls(m["action"], m["broker"], at_s=float(m["when"]), hold_s=hold)  # type: ignore[arg-type]

    def spec(self) -> str:
        when = f"{self.records}r" if self.records is not None else f"{self.at_s:g}s"
        hold = f"+{self.hold_s:g}" if self.hold_s else ""
        return f"{self.action}:{self.broker}@{when}{hold}"


@dataclass(frozen=True)
class FaultEvent:
    """A fault that happened: wall time (epoch ms), seconds since the schedule started."""

    at_ms: int
    elapsed_s: float
    action: str
    broker: str
    messages: int | None = None
    error: str | None = None


@dataclass
class _Due:
    fault: Fault
    at_s: float | None
    records: int | None
    follow_up: bool = False


class FaultRunner:
    """Fires a fault schedule against a fleet from a background thread.

    Record triggers read the fleet's message count every ``poll_s`` (a broker
    process has no way to signal it); the schedule ends when every fault has
    fired, on ``stop()``, or after ``max_s`` seconds. ``stop()`` completes the
    follow-ups still owed (SIGCONT a stopped broker, restart a killed one that
    had a hold) so no broker is left hung.
    """

    def __init__(
        self,
        fleet: Fleet,
        faults: Iterable[Fault],
        poll_s: float = 0.05,
        max_s: float = 600.0,
        on_event: Callable[[FaultEvent], None] | None = None,
    ) -> None:
        self.fleet = fleet
        self.on_event = on_event
        self.faults = list(faults)
        for f in self.faults:
            if f.broker not in fleet.brokers:
                raise ValueError(f"fault on unknown broker {f.broker!r}")
        self.poll_s = poll_s
        self.max_s = max_s
        self.events: list[FaultEvent] = []
        self.done = threading.Event()
        self._stop = threading.Event()
        self._pending = [_Due(f, f.at_s, f.records) for f in self.faults]
        self._lock = threading.Lock()
        self._started = 0.0
        self._thread = threading.Thread(target=self._run, name="fault-runner", daemon=True)

    def start(self) -> FaultRunner:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            deadline = self._started + self.max_s
            while time.monotonic() < deadline and not self._stop.is_set():
                with self._lock:
                    if not self._pending:
                        break
                    self._fire_due()
                    if not self._pending:
                        break
                self._stop.wait(self.poll_s)
        finally:
            self.done.set()

    def _fire_due(self) -> None:
        elapsed = time.monotonic() - self._started
        count: int | None = None
        for due in list(self._pending):
            if due.records is not None:
                if count is None:
                    count = self.fleet.messages()
                if count < due.records:
                    continue
            elif due.at_s is not None and elapsed < due.at_s:
                continue
            self._pending.remove(due)
            self._fire(due, elapsed, count)

    def _fire(self, due: _Due, elapsed: float, count: int | None) -> None:
        f = due.fault
        action: str = f.action
        broker = self.fleet.brokers[f.broker]
        error: str | None = None
        try:
            if due.follow_up:
                action = {"stop": "cont", "kill": "restart"}[f.action]
            if action == "stop":
                broker.stop()
            elif action == "cont":
                broker.cont()
            elif action == "kill":
                broker.kill()
            elif action == "restart":
                broker.restart()
            elif action == "pause":
                broker.pause(f.hold_s or 0.0)
            elif action == "sleep":
                broker.sleep(f.hold_s or 0.0)
        except Exception as exc:  # noqa: BLE001 - a fault that could not fire is logged, not fatal
            error = repr(exc)
        event = FaultEvent(
            time.time_ns() // 1_000_000, round(elapsed, 3), action, f.broker, count, error
        )
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)
        if not due.follow_up and f.hold_s and f.action in ("stop", "kill"):
            self._pending.append(_Due(f, elapsed + f.hold_s, None, follow_up=True))

    def wait(self, timeout_s: float) -> bool:
        """Wait until every fault (and follow-up) has fired; False on timeout."""
        return self.done.wait(timeout_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        """End the schedule now; owed follow-ups (SIGCONT, restart) fire at once."""
        self._stop.set()
        self._thread.join(timeout_s)
        with self._lock:
            owed = [d for d in self._pending if d.follow_up]
            self._pending.clear()
            for due in owed:
                self._fire(due, time.monotonic() - self._started, None)

    def first(self, action: str, broker: str | None = None) -> FaultEvent | None:
        """The first event of ``action`` (on ``broker``), if it happened."""
        for e in self.events:
            if e.action == action and (broker is None or e.broker == broker):
                return e
        return None


# -- the fleet ------------------------------------------------------------------------------


@dataclass
class Fleet:
    """N stand-in brokers for one topic; a context manager that ends every process it started.

    ``Fleet(4, "orders").start().register(detour_url)`` then ``fleet.faults([...]).start()``.
    """

    n: int = 4
    topic: str = "detour-pipeline"
    queues: int = 4
    persist: bool = True
    root: Path | None = None
    brokers: dict[str, Broker] = field(default_factory=dict)
    #: Broker names whose fault items ``register`` dropped (they were an earlier fleet's).
    forgotten: list[str] = field(default_factory=list)
    _own_root: bool = False
    _last_counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.n <= 256 or not 1 <= self.queues <= 1024:
            raise ValueError("a fleet has 1..256 brokers of 1..1024 queues")
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="detour-brokers-"))
            self._own_root = True

    def start(self) -> Fleet:
        assert self.root is not None
        try:
            for name in broker_names(self.n):
                b = Broker(name, self.queues, self.root, persist=self.persist)
                self.brokers[name] = b
                b.start()
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> Fleet:
        return self if self.brokers else self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def route(self) -> dict[str, Any]:
        """The ``PUT /routes/{topic}`` body: every broker with its queues and address."""
        return {
            "brokers": [
                {"brokerName": b.name, "writeQueueNums": b.queues, "address": b.address}
                for b in self.brokers.values()
            ]
        }

    def register(self, detour_url: str, timeout_s: float = 5.0,
                 token: str | None = None, forget: bool = True) -> Fleet:
        """Register the fleet as the topic's route in Detour (raises on a non-2xx answer).

        ``forget``: also drop Detour's fault items for these broker names
        (``DELETE /fault-items/{name}``). Why by default: the names are reused run after
        run (broker-a, broker-b...) but the processes are new, so a window an earlier
        fleet's broker-b earned (an isolation: 10 minutes) would keep this fleet's
        healthy broker-b avoided. ``token``: an admin token, sent as
        ``Authorization: Bearer`` (None: no header).
        """
        base = detour_url.rstrip("/")
        headers = auth_headers(token)
        with httpx.Client(base_url=base, headers=headers, timeout=timeout_s) as c:
            c.put(f"/routes/{self.topic}", json=self.route()).raise_for_status()
            if forget:
                self.forgotten = []
                for name in self.brokers:
                    r = c.delete(f"/fault-items/{name}")
                    if r.status_code == 204:
                        self.forgotten.append(name)
                    elif r.status_code != 404:  # 404: Detour knew nothing of it
                        r.raise_for_status()
        return self

    def describe(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "dir": str(self.root),
            "brokers": [b.describe() for b in self.brokers.values()],
            "forgotten": self.forgotten,
        }

    def addresses(self) -> dict[str, str]:
        return {b.name: b.address for b in self.brokers.values()}

    def messages(self) -> int:
        """Messages on the fleet; a broker that does not answer counts with its last count."""
        total = 0
        for name, b in self.brokers.items():
            if b.state == "up":
                try:
                    self._last_counts[name] = b.messages(self.topic, timeout_s=0.2)
                except redis.RedisError:
                    pass
            total += self._last_counts.get(name, 0)
        return total

    def faults(
        self,
        faults: Iterable[Fault | str],
        poll_s: float = 0.05,
        max_s: float = 600.0,
        on_event: Callable[[FaultEvent], None] | None = None,
    ) -> FaultRunner:
        """A (not yet started) runner for a schedule of ``Fault``s or spec strings."""
        parsed = [f if isinstance(f, Fault) else Fault.parse(f) for f in faults]
        return FaultRunner(self, parsed, poll_s=poll_s, max_s=max_s, on_event=on_event)

    def close(self) -> None:
        for b in self.brokers.values():
            b.close()
        if self._own_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


# -- CLI ------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.brokers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="start a fleet, register it, run faults, wait for Ctrl-C")
    s.add_argument("--n", type=int, default=4, help="brokers (default 4)")
    s.add_argument("--queues", type=int, default=4, help="write queues per broker (default 4)")
    s.add_argument("--topic", default="detour-pipeline")
    s.add_argument("--detour", default=None, help="Detour URL to register the route with")
    s.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="ACTION:BROKER@WHEN[+HOLD], repeatable (see above)")
    s.add_argument("--no-persist", action="store_true",
                   help="--appendonly no: a killed broker loses its messages")
    s.add_argument("--keep-faults", action="store_true",
                   help="keep Detour's fault items for these broker names (by default they "
                        "are dropped: they were an earlier fleet's)")
    s.add_argument("--dir", type=Path, default=None, help="data dirs (default: a temp dir)")
    s.add_argument("--events", type=Path, default=None,
                   help="also append each fault as it fires to this file, one JSON line "
                        "(pipeline.analyze --faults marks them on its plots)")
    s.add_argument("--for", dest="for_s", type=float, default=None,
                   help="stop after this many seconds (default: until Ctrl-C)")
    add_token_argument(s, "admin")
    return p


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    args = _parser().parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    fleet = Fleet(args.n, args.topic, args.queues, persist=not args.no_persist, root=args.dir)
    runner: FaultRunner | None = None
    try:
        fleet.start()
        if args.detour:
            fleet.register(args.detour, token=detour_token(args.token),
                           forget=not args.keep_faults)

        def show(event: FaultEvent) -> None:
            line = json.dumps({"fault": asdict(event)})
            out(line)
            sys.stdout.flush()
            if args.events is not None:
                with open(args.events, "a", encoding="utf-8") as f:
                    f.write(line + "\n")

        runner = fleet.faults(args.fault, on_event=show)
        out(json.dumps(fleet.describe()))
        sys.stdout.flush()
        runner.start()
        stop.wait(args.for_s)
    finally:
        if runner is not None:
            runner.stop()
        fleet.close()
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


if __name__ == "__main__":
    sys.exit(main())
