"""A live progress line in the driver: rate, failed attempts, brokers avoided now, ETA.

Why not Spark's own means: accumulators reach the driver only when a task ends,
and the status tracker counts tasks, not records, so a job of four partitions
on two cores would show nothing until half of it is done. Instead each task
sends its cumulative counters to a UDP socket on the driver, at most every
``SEND_EVERY_S`` and once at its end: fire and forget (a task never waits on
it; a lost datagram is superseded by the next one, since the counters are
cumulative), about a hundred bytes each. The driver adds up the latest counters
of each partition (a retried task's newest attempt replaces the old one) and
prints a line to stderr: rewritten in place every second on a terminal, a
new line every ``LOG_EVERY_S`` otherwise (a log file gets a readable trail),
and a last line when the job ends. Tasks running and done come from Spark's
status tracker, so where executors cannot reach the driver's socket (a
firewall between them on a cluster) the line still moves, task by task.

Executors send to the address the driver advertises (``spark.driver.host``;
``127.0.0.1`` for a local master), and only datagrams carrying the job's random
key count.
"""

from __future__ import annotations

import json
import math
import secrets
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark import SparkContext

#: Seconds between two datagrams of one task (and the first one is sent at once).
SEND_EVERY_S = 0.5
#: Seconds between lines when stderr is not a terminal (the first comes after one).
LOG_EVERY_S = 5.0
#: Seconds between redraws on a terminal.
TTY_EVERY_S = 1.0
#: A partition's avoided brokers count as "now" for this long after its last datagram.
FRESH_S = 3.0
#: The rate is measured over this many seconds.
RATE_WINDOW_S = 5.0
#: The largest datagram read.
MAX_DATAGRAM = 8192
#: A line whose counts have not changed is printed again only after this many seconds
#: (a sign of life while tasks start or stall), never at every tick.
HEARTBEAT_S = 30.0


@dataclass(frozen=True)
class ProgressAddress:
    """Where tasks send their counters; travels to the executors inside the job's closure."""

    host: str
    port: int
    key: str = field(repr=False)


class ProgressSender:
    """One task's side: ``update`` after each record (or page), ``close`` at the end.

    Sends at most every ``every_s``; never raises and never blocks on the network
    (UDP to an address nobody listens on is dropped by the kernel). The brokers
    sent are those avoided by any update since the previous datagram: one select
    that happened to land on a healthy broker passed over nothing, although its
    neighbours did.
    """

    def __init__(
        self,
        address: ProgressAddress | None,
        partition: int,
        attempt: int = 0,
        every_s: float = SEND_EVERY_S,
    ) -> None:
        self.address = address
        self.partition = partition
        self.attempt = attempt
        self.every_s = every_s
        self._next = 0.0
        self._avoided: set[str] = set()
        #: Epoch ms of the first unit's start and the last one's end (sent when given).
        self._first_ms: int | None = None
        self._last_ms: int | None = None
        self._sock: socket.socket | None = None
        if address is not None:
            try:
                self._sock = socket.socket(_family(address.host), socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            except OSError:
                self._sock = None

    def update(
        self,
        done: int,
        failed: int = 0,
        avoided: Iterable[str] = (),
        total: int | None = None,
        final: bool = False,
        span_ms: tuple[int, int] | None = None,
    ) -> None:
        """The task's counters so far; sent now if ``every_s`` has passed or ``final``.

        ``span_ms``: the epoch ms the unit just done started and ended (a record's
        ``started_at`` and ``sent_at``): the task's first start and last end are sent,
        so the driver's rate is over the time spent sending, as the job's summary is."""
        if self._sock is None or self.address is None:
            return
        self._avoided.update(avoided)
        if span_ms is not None:
            first, last = span_ms
            self._first_ms = first if self._first_ms is None else min(self._first_ms, first)
            self._last_ms = last if self._last_ms is None else max(self._last_ms, last)
        now = time.monotonic()
        if not final and now < self._next:
            return
        self._next = now + self.every_s
        body = {
            "k": self.address.key, "p": self.partition, "a": self.attempt, "n": done,
            "f": failed, "v": sorted(self._avoided), "t": total, "d": final,
            "s": self._first_ms, "e": self._last_ms,
        }
        self._avoided.clear()
        try:
            self._sock.sendto(json.dumps(body).encode(), (self.address.host, self.address.port))
        except OSError:
            pass  # progress is best effort: the job's work never depends on it

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def task_attempt() -> int:
    """The running task's attempt number (0 outside a task)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return 0 if ctx is None else int(ctx.attemptNumber())


@dataclass(frozen=True)
class Snapshot:
    """What the line shows, at one moment."""

    done: int
    failed: int
    avoided: tuple[str, ...]
    total: int | None
    rate: float
    eta_s: float | None
    elapsed_s: float
    tasks_done: int | None = None
    tasks: int | None = None
    #: From the first unit's start to the last one's end over every task (None when the
    #: tasks do not say): the summary's denominator.
    sending_s: float | None = None

    def shown(self) -> tuple[object, ...]:
        """What a line says apart from rates and times: a line is printed when it changes."""
        return (self.done, self.failed, self.avoided, self.total, self.tasks_done, self.tasks)


@dataclass
class _Part:
    attempt: int
    done: int
    failed: int
    avoided: tuple[str, ...]
    total: int | None
    final: bool
    seen: float
    first_ms: int | None = None
    last_ms: int | None = None


class Progress:
    """The driver's side: a socket the tasks send to and the line it prints.

    ``total``: the units the job will have done at the end (None until known;
    ``set_total`` later); ``parts``: how many partitions will report a total of
    their own, when the total comes from them (verify learns it from the streams'
    lengths). Use as a context manager around the Spark action.
    """

    def __init__(
        self,
        label: str,
        unit: str,
        sc: SparkContext | None = None,
        total: int | None = None,
        parts: int | None = None,
        failures: str | None = None,
        out: IO[str] | None = None,
        every_s: float | None = None,
        host: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.unit = unit
        self.failures = failures
        self.total = total
        self.parts = parts
        self.out = out if out is not None else sys.stderr
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        default_every = TTY_EVERY_S if self.tty else LOG_EVERY_S
        self.every_s = every_s if every_s is not None else default_every
        self._sc = sc
        self._clock = clock
        self._parts: dict[int, _Part] = {}
        self._history: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = clock()
        #: What the last periodic line showed (Snapshot.shown) and when.
        self._shown: tuple[object, ...] | None = None
        self._shown_at = 0.0
        self.lines: list[str] = []  # every line printed, for the caller's log or a test
        bind, advertised = _addresses(sc, host)
        self._sock = socket.socket(_family(bind), socket.SOCK_DGRAM)
        self._sock.bind((bind, 0))
        self._sock.settimeout(0.2)
        self.address = ProgressAddress(advertised, int(self._sock.getsockname()[1]),
                                       secrets.token_hex(8))

    # -- receiving ---------------------------------------------------------------------

    def receive(self, datagram: bytes) -> bool:
        """Take one datagram; False when it is not this job's or not well formed."""
        try:
            body = json.loads(datagram)
            if body.get("k") != self.address.key:
                return False
            p, a = int(body["p"]), int(body["a"])
            part = _Part(a, int(body["n"]), int(body["f"]), tuple(str(b) for b in body["v"]),
                         None if body.get("t") is None else int(body["t"]), bool(body["d"]),
                         self._clock(),
                         None if body.get("s") is None else int(body["s"]),
                         None if body.get("e") is None else int(body["e"]))
        except (ValueError, KeyError, TypeError):
            return False
        with self._lock:
            old = self._parts.get(p)
            # The newest attempt wins; within one, the counters only grow.
            if old is None or a > old.attempt or (a == old.attempt and part.done >= old.done):
                self._parts[p] = part
        return True

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                return
            self.receive(data)

    # -- the line ----------------------------------------------------------------------

    def set_total(self, total: int | None) -> None:
        self.total = total

    def snapshot(self) -> Snapshot:
        now = self._clock()
        with self._lock:
            parts = list(self._parts.values())
        done = sum(p.done for p in parts)
        failed = sum(p.failed for p in parts)
        avoided = sorted({b for p in parts if now - p.seen <= FRESH_S for b in p.avoided})
        total = self.total
        if total is None and self.parts is not None and len(parts) >= self.parts \
                and all(p.total is not None for p in parts):
            total = sum(p.total or 0 for p in parts)
        firsts = [p.first_ms for p in parts if p.first_ms is not None]
        lasts = [p.last_ms for p in parts if p.last_ms is not None]
        sending_s = (max(lasts) - min(firsts)) / 1000 if firsts and lasts else None
        # The rate over the last RATE_WINDOW_S, from the first unit done on: the seconds
        # before it (Spark starting its tasks) are not time spent sending.
        if done > 0:
            self._history.append((now, done))
        while len(self._history) > 2 and now - self._history[1][0] >= RATE_WINDOW_S:
            self._history.popleft()
        if len(self._history) >= 2 and now > self._history[0][0]:
            t0, d0 = self._history[0]
            rate = (done - d0) / (now - t0)
        else:
            rate = done / max(0.001, sending_s) if sending_s is not None and done else 0.0
        eta = (max(0, total - done) / rate) if total is not None and rate > 0 else None
        tasks_done, tasks = self._tasks()
        return Snapshot(done, failed, tuple(avoided), total, rate, eta, now - self._started,
                        tasks_done, tasks, sending_s)

    def _tasks(self) -> tuple[int | None, int | None]:
        """Tasks done and in all, over the active stages (the status tracker; None when idle)."""
        if self._sc is None:
            return None, None
        try:
            tracker = self._sc.statusTracker()
            infos = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
        except Exception:  # noqa: BLE001 - a stopping context: no task count this time
            return None, None
        known = [i for i in infos if i is not None]
        if not known:
            return None, None
        return sum(i.numCompletedTasks for i in known), sum(i.numTasks for i in known)

    def line(self, s: Snapshot, final: bool = False) -> str:
        parts = [f"{self.label}: {s.done:,}"
                 + (f"/{s.total:,}" if s.total is not None else "") + f" {self.unit}"]
        if s.total:
            parts[0] += f" ({min(100.0, 100.0 * s.done / s.total):.0f} %)"
        if final and s.sending_s is not None:
            # The job summary's figure: units / (last end - first start), at least 1 ms.
            overall = s.done / max(0.001, s.sending_s)
            parts.append(f"{overall:,.0f}/s over {s.sending_s:.1f} s sending "
                         f"({s.elapsed_s:.1f} s in all)")
        elif final:
            overall = s.done / s.elapsed_s if s.elapsed_s > 0 else 0.0
            parts.append(f"{overall:,.0f}/s over {s.elapsed_s:.1f} s")
        elif s.done == 0:
            # Spark is still starting the tasks: no rate, no ETA yet.
            parts.append(f"waiting for the first {self.unit} ({s.elapsed_s:.0f} s)")
            if s.tasks is not None:
                parts.append(f"tasks {s.tasks_done}/{s.tasks}")
            return " · ".join(parts)
        else:
            parts.append(f"{s.rate:,.0f}/s")
        if self.failures is not None:
            parts.append(f"{s.failed:,} {self.failures}")
            if not final:
                parts.append("avoiding " + (", ".join(s.avoided) if s.avoided else "none"))
        if s.tasks is not None and not final:
            parts.append(f"tasks {s.tasks_done}/{s.tasks}")
        if not final:
            done = s.total is not None and s.done >= s.total
            # All sent, tasks not ended: they are flushing their last reports, closing.
            parts.append("finishing" if done else "ETA " + _duration(s.eta_s))
        return " · ".join(parts)

    def _emit(self, text: str, final: bool = False) -> None:
        self.lines.append(text)
        if self.tty:
            self.out.write("\r\x1b[2K" + text + ("\n" if final else ""))
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def say(self, what: str) -> None:
        """A line now, between the job's phases (so no stretch of the run is silent)."""
        self._emit(f"{self.label}: {what}", final=True)

    def tick(self) -> str | None:
        """The periodic line, or None when it would say what the last one said (the same
        counts, tasks and brokers; before the first unit, nothing yet) and less than
        ``HEARTBEAT_S`` has passed since: a log then holds one "0/10,000" line at most,
        not one per tick while Spark starts its tasks."""
        s = self.snapshot()
        now = self._clock()
        if self._shown is not None and s.shown() == self._shown \
                and now - self._shown_at < HEARTBEAT_S:
            return None
        if self._shown is None and s.done == 0 and s.elapsed_s < HEARTBEAT_S:
            return None  # the "sending" line said it has started; nothing to add yet
        self._shown, self._shown_at = s.shown(), now
        return self.line(s)

    def _print(self) -> None:
        wait = min(self.every_s, TTY_EVERY_S)  # a first line soon, then every every_s
        while not self._stop.wait(wait):
            text = self.tick()
            if text is not None:
                self._emit(text)
            wait = self.every_s

    # -- lifetime ----------------------------------------------------------------------

    def __enter__(self) -> Progress:
        self._started = self._clock()
        for target in (self._listen, self._print):
            t = threading.Thread(target=target, name=f"progress-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        """Close the socket of a line that was never entered (nothing is printed)."""
        self._sock.close()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(2.0)
        # What is still queued on the socket (the tasks' last datagrams) before the last line.
        self._sock.settimeout(0)
        for _ in range(10_000):  # bounded: at most what a socket buffer holds
            try:
                self.receive(self._sock.recv(MAX_DATAGRAM))
            except OSError:
                break
        self._sock.close()
        self._emit(self.line(self.snapshot(), final=True), final=True)


def _duration(seconds: float | None) -> str:
    if seconds is None or math.isinf(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.0f} s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s:02d} s"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _addresses(sc: SparkContext | None, host: str | None) -> tuple[str, str]:
    """(address to bind, address executors send to): loopback for local masters."""
    if host is not None:
        return host, host
    if sc is None or (sc.master or "local").startswith("local"):
        return "127.0.0.1", "127.0.0.1"
    conf = sc.getConf()
    advertised = conf.get("spark.driver.host") or socket.gethostname()
    bind = conf.get("spark.driver.bindAddress") or advertised
    try:
        bind = socket.gethostbyname(bind)
    except OSError:
        bind = "0.0.0.0"
    return bind, advertised
