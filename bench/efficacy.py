"""``python -m bench.efficacy``: does a shared fault table spare producers? Real processes.

M producer processes (16) send at a fixed rate (20 msg/s each) to N stand-in
brokers (8 ``redis-server`` processes x 2 queues, ``pipeline.brokers``), one
``XADD`` per message, under one fault schedule, once per strategy:

``no-avoidance``
    round robin, a retry on another broker (``sendLatencyFaultEnable=false``).
``per-producer``
    RocketMQ 4.x: each producer process its own fault table, the SDK's local
    table (``detour.client.local.LocalTable``: ``detour.strategy`` over a
    ``TableView``), fed by its own reports only, and the SDK's send loop.
``detour-cached``
    Detour's shared table (the service on Redis), SDK cached mode: in-process
    selects over the table pushed by ``GET /fault-items/stream``.
``detour-http``
    the same, SDK remote mode: a ``POST /select`` and a ``POST /report-latency``
    per attempt.
``detour-recover``
    ``detour-cached`` with the recovery settings docs/policy.md recommends
    (``RECOVER``: the staggered return ``rampMs`` 3000, ``earlyRecovery`` with the
    active detector every 500 ms, ``repeatMultiplier``). Neither is scaled: the ramp
    covers the time a slow answer takes to be reported, the detector's interval the
    time to notice a restart, and neither of those is scaled either.
``detour-pending``
    ``detour-cached`` with the recommended in-flight signals (``PENDING``:
    ``pendingQuorum`` 2; the SDK signals a send outstanding 4 x the broker's p99,
    at least 50 ms): a hang is avoided before the first timeout fires.
``detour-all``
    ``detour-cached`` with every recommended setting at once (``RECOVER`` and
    ``PENDING``): what a deployment following docs/policy.md runs.
``detour-default``
    Detour as it comes: the ``recommended`` profile (detour/profiles.py), which is
    ``detour-all`` plus ``latencyQuorum`` 2, set by naming the profile only.

The fault schedule (``--faults``, seconds from the start of each arm):

    kill:broker-b@2+6    SIGKILL, restarted 6 s later (same port, AOF)
    stop:broker-c@10+5   SIGSTOP (a hang: sends time out), SIGCONT 5 s later
    slow:broker-d@18+8   every reply delayed ``--slow-ms`` (600 ms) for 8 s

A slow broker is a delay proxy (a child process of this one, asyncio, in
front of that broker only; toggled by SIGUSR1/SIGUSR2): 600 ms lands in
RocketMQ's 550 ms tier, so the slow sends open windows without timing out.

Time is scaled down by ``--scale`` (40): every ``notAvailableDuration`` tier is
divided by it (a failure's 600 s isolation becomes 15 s, the 550 ms tier's 30 s
becomes 0.75 s), set on Detour with ``PATCH /config`` and given to the
per-producer tables as the same ``Config``. Latency thresholds are not scaled:
they are what a send measures. The per-attempt timeout (``--timeout``, 1 s) is
the broker client's socket timeout: a send to the hung broker fails after it;
it has to exceed the slow broker's 600 ms, or the slow broker would be a
second hang.

Counted per arm: attempts; failed attempts; *bad* attempts (failed, or at least
550 ms) on each faulty broker that overlap its fault, and how many producers
made them; messages that exhausted their 3 attempts; message send time
(every attempt, select and report included) p50/p99/max; the time from a fault
to the last bad attempt on its broker; the time from the recovery (restart,
SIGCONT, delay off) to the broker's first good send, and to the broker's
carrying at least half its fair share of good sends again (in a 0.25 s bin); and the
share of the never-faulty brokers' fair traffic lost to false avoidance (per 1 s, each
such broker's shortfall below their mean, summed, over their good sends).

Producers are forked once at the start and reused by every arm; each arm gets a
fresh fleet, and Detour's table is cleared between arms. 127.0.0.1 only; every
process started is stopped on the way out. Writes ``efficacy.json`` and
``efficacy.md`` under ``--out``, and the plots (``efficacy-timeline.png``,
``efficacy-latency-cdf.png``) there and under ``--img`` if given.

    python -m bench.efficacy                       # defaults: about 3 minutes
    python -m bench.efficacy --repeats 3 --img docs/img
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx

from pipeline.brokers import Fleet, free_port
from tests.procs import end_process

ARMS = ("no-avoidance", "per-producer", "detour-cached", "detour-http", "detour-recover",
        "detour-pending", "detour-all", "detour-default")
#: The recovery arm's extra Config (docs/policy.md's recommended recovery settings).
RECOVER: dict[str, Any] = {
    "rampMs": 3000, "earlyRecovery": True, "detectorEnable": True, "detectIntervalMs": 500,
    "repeatMultiplier": True,
}
#: The detour-pending arm's config on top of the others' (docs/policy.md, "Hangs").
PENDING = {"pendingQuorum": 2}
#: Arms on the cached SDK, and the extra Config each adds: detour-all is every recommended
#: setting at once (docs/policy.md), what a new deployment following the docs runs.
#: Each starts from a named profile (detour/profiles.py), so no arm inherits the one before
#: it: detour-default is the out-of-the-box config (``recommended``) with nothing added.
ROCKETMQ = {"profile": "rocketmq-4"}
CACHED_ARMS: dict[str, dict[str, Any]] = {
    "detour-cached": ROCKETMQ, "detour-recover": {**ROCKETMQ, **RECOVER},
    "detour-pending": {**ROCKETMQ, **PENDING}, "detour-all": {**ROCKETMQ, **RECOVER, **PENDING},
    "detour-default": {"profile": "recommended"},
}
#: A send at least this long is a bad attempt: RocketMQ's first tier that opens a window.
SLOW_MS = 550.0
DEFAULT_FAULTS = "kill:broker-b@2+6,stop:broker-c@10+5,slow:broker-d@18+8"
#: RocketMQ's tiers; the bench divides the windows by --scale, never the latencies.
LATENCY_MAX = (50, 100, 550, 1000, 2000, 3000, 15000)
NOT_AVAILABLE = (0, 0, 30000, 60000, 120000, 180000, 600000)


@dataclass(frozen=True)
class FaultSpec:
    """``ACTION:BROKER@AT+HOLD``: kill (then restart), stop (then cont), slow (then fast)."""

    action: str
    broker: str
    at_s: float
    hold_s: float

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        try:
            action, rest = text.strip().split(":", 1)
            broker, when = rest.split("@", 1)
            at, hold = when.split("+", 1)
            spec = cls(action, broker, float(at), float(hold))
        except ValueError as exc:
            raise ValueError(f"bad fault {text!r}: want ACTION:BROKER@AT+HOLD") from exc
        if action not in ("kill", "stop", "slow") or spec.hold_s <= 0 or spec.at_s < 0:
            raise ValueError(f"bad fault {text!r}: action kill|stop|slow, hold > 0")
        return spec

    @property
    def kind(self) -> str:
        return {"kill": "crash", "stop": "hang", "slow": "slow"}[self.action]


def scaled_config(scale: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``PATCH /config`` body: RocketMQ's tiers with every window divided by ``scale``,
    and ``extra`` policy fields (``--config``, e.g. ``{"latencyQuorum": 2}``) on top."""
    return {
        "sendLatencyFaultEnable": True,
        "latencyMax": list(LATENCY_MAX),
        "notAvailableDuration": [int(round(d / scale)) for d in NOT_AVAILABLE],
        "isolationLatencyMs": 30000,
        "lastReportWins": False,
        **(extra or {}),
    }


# -- the delay proxy (the slow broker) ---------------------------------------------------------


async def _proxy(listen: int, upstream: int, delay_s: float) -> None:
    slow = [False]
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: slow.__setitem__(0, True))
    loop.add_signal_handler(signal.SIGUSR2, lambda: slow.__setitem__(0, False))
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: bool) -> None:
        try:
            while data := await src.read(65536):
                if delay and slow[0]:
                    await asyncio.sleep(delay_s)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, uw, False), pipe(ur, writer, True))

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    print("ready", flush=True)
    async with server:
        await stop.wait()


class DelayProxy:
    """A child process forwarding 127.0.0.1:``port`` to a broker; replies delayed while slow."""

    def __init__(self, upstream: int, delay_ms: float) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.efficacy", "_proxy", str(self.port), str(upstream),
             str(delay_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the proxy's "ready" once it listens (or EOF)
        if line.strip() != b"ready":
            self.stop()
            raise RuntimeError("delay proxy did not start")

    def slow(self, on: bool) -> None:
        self.proc.send_signal(signal.SIGUSR1 if on else signal.SIGUSR2)

    def stop(self) -> None:
        end_process(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# -- producers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    arm: str
    topic: str
    detour: str | None
    route: dict[str, Any]
    config: dict[str, Any]
    rate: float
    duration_s: float
    timeout_s: float
    retries: int
    deadline_s: float
    #: the SDK's in-flight signal rule (detour.client.inflight)
    pending_factor: float = 4.0
    pending_floor_ms: float = 50.0


def _config(body: dict[str, Any], enabled: bool) -> Any:
    from detour.model import Config

    return replace(Config.from_wire(body), send_latency_fault_enable=enabled)


def _route(topic: str, body: dict[str, Any]) -> Any:
    from detour.model import BrokerRoute, Route

    return Route.from_brokers(topic, [
        BrokerRoute(b["brokerName"], b["writeQueueNums"], b["address"]) for b in body["brokers"]
    ])


def run_producer(index: int, producers: int, job: Job, conn: Connection) -> dict[str, Any]:
    """One producer's arm: build its sender, say ready, wait for go, send at the fixed rate.

    Returns its attempts ``(start s, duration s, broker, ok)`` and messages
    ``(start s, duration s, attempts, ok)``, times from the arm's start.
    """
    from detour.client import DetourClient, DetourClientError, SendError
    from detour.client.core import wall_ms
    from detour.client.errors import DetourUnavailable
    from detour.client.local import LocalTable
    from detour.client.send import send_sync
    from detour.client.values import SelectedQueue
    from pipeline.produce import Deliverer

    brokers = [b["brokerName"] for b in job.route["brokers"]]
    bidx = {b: i for i, b in enumerate(brokers)}
    inner = Deliverer(job.topic, job.timeout_s)
    attempts: list[tuple[float, float, int, bool]] = []
    messages: list[tuple[float, float, int, bool]] = []
    t0 = [0.0]

    def deliver(q: SelectedQueue, rec: tuple[str, str]) -> str:
        start = time.monotonic()
        ok = False
        try:
            out = inner(q, rec)
            ok = True
            return out
        finally:
            attempts.append((start - t0[0], time.monotonic() - start, bidx[q.broker_name], ok))

    client: DetourClient | None = None
    send: Callable[[tuple[str, str]], Any]
    if job.arm in ("no-avoidance", "per-producer"):
        table = LocalTable(wall_ms)
        table.set_config(_config(job.config, job.arm == "per-producer"))
        table.set_route(job.topic, _route(job.topic, job.route))

        def local_select(topic: str, last: str | None) -> SelectedQueue:
            sel = table.select(topic, last)
            if sel is None:
                raise DetourUnavailable(f"no route for {topic}")
            return sel

        def local_report(broker: str, ms: float, iso: bool) -> None:
            table.apply_report(broker, ms, iso)

        def send(rec: tuple[str, str]) -> Any:
            return send_sync(job.topic, rec, deliver, select=local_select,
                             report=local_report,
                             retries=job.retries, deadline=job.deadline_s)
    else:
        assert job.detour is not None
        cached = job.arm in CACHED_ARMS
        client = DetourClient(job.detour, mode="cached" if cached else "remote",
                              retries=job.retries, deadline=job.deadline_s,
                              producer=f"efficacy-{index}", pending_factor=job.pending_factor,
                              pending_floor_ms=job.pending_floor_ms)
        if not client.wait_ready(15):
            raise RuntimeError(f"producer {index}: Detour not ready")

        def send(rec: tuple[str, str]) -> Any:
            assert client is not None
            return client.send(job.topic, rec, deliver)

    try:
        conn.send(("ready", index))
        if not conn.poll(60):
            raise TimeoutError("no go from the harness")
        msg = conn.recv()
        t0[0] = float(msg[1])
        interval = 1.0 / job.rate
        # spread the producers' sends evenly over one interval
        due = t0[0] + interval * index / producers
        end = t0[0] + job.duration_s
        k = 0
        while due < end:
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # pacing to the fixed rate, not synchronisation
            start = time.monotonic()
            n_before = len(attempts)
            ok = True
            try:
                send((f"{index}-{k}", "x" * 64))
            except SendError:
                ok = False
            except DetourClientError:
                ok = False
            messages.append((start - t0[0], time.monotonic() - start,
                             len(attempts) - n_before, ok))
            k += 1
            # a producer that fell behind (a hang) does not burst to catch up
            due = max(due + interval, time.monotonic() - interval)
    finally:
        inner.close()
        if client is not None:
            client.close(flush_timeout=2.0)
    return {"index": index, "attempts": attempts, "messages": messages}


def _worker(index: int, producers: int, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness ends us
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            conn.send(("done", run_producer(index, producers, job, conn)))
        except Exception as exc:  # noqa: BLE001 - reported to the harness, which fails the arm
            conn.send(("error", f"producer {index}: {exc!r}"))


class Producers:
    """M producer processes, forked once (before any thread starts here) and reused."""

    def __init__(self, m: int) -> None:
        ctx = mp.get_context("fork")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(m):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(i, m, child), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, job: Job, on_go: Callable[[float], None], timeout_s: float) -> list[Any]:
        """Send ``job`` to every producer, wait until all are ready, start them together.

        ``on_go(t0)`` runs the fault schedule in this process (monotonic t0, shared
        by every process on the machine). Raises RuntimeError if a producer fails.
        """
        for c in self.conns:
            c.send(job)
        for c in self.conns:
            if not c.poll(timeout_s):
                raise TimeoutError("a producer did not get ready")
            kind, detail = c.recv()
            if kind != "ready":
                raise RuntimeError(detail)
        t0 = time.monotonic() + 0.2
        for c in self.conns:
            c.send(("go", t0))
        on_go(t0)
        out = []
        for c in self.conns:
            if not c.poll(timeout_s + job.duration_s):
                raise TimeoutError("a producer did not finish")
            kind, detail = c.recv()
            if kind != "done":
                raise RuntimeError(detail)
            out.append(detail)
        return out

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)


# -- one arm -----------------------------------------------------------------------------------


@dataclass
class FaultRecord:
    kind: str
    broker: str
    start_s: float
    end_s: float


def run_faults(fleet: Fleet, proxy: DelayProxy | None, faults: Sequence[FaultSpec], t0: float,
               duration_s: float, tick: Callable[[float], None]) -> list[FaultRecord]:
    """Fire the schedule at its times from ``t0``; returns when the arm's time is over.

    A fault's start is stamped as its action begins (the signal is sent), its end
    once the recovery completed (a restart once the broker accepts connections
    again).
    """
    steps: list[tuple[float, int, str, FaultSpec]] = []
    for i, f in enumerate(faults):
        steps.append((f.at_s, i, "on", f))
        steps.append((f.at_s + f.hold_s, i, "off", f))
    steps.sort(key=lambda s: (s[0], s[1]))
    starts: dict[int, float] = {}
    records: list[FaultRecord] = []
    waiter = threading.Event()  # never set: an interruptible timed wait
    done_s = 0.0
    for at, i, what, f in [*steps, (duration_s, -1, "end", faults[0])]:
        while (now := time.monotonic() - t0) < at:
            waiter.wait(min(0.5, at - now))  # pacing the schedule, not synchronisation
            tick(now - done_s)
            done_s = now
        if what == "end":
            break
        broker = fleet.brokers[f.broker]
        before = time.monotonic() - t0
        if f.action == "kill":
            broker.kill() if what == "on" else broker.start()
        elif f.action == "stop":
            broker.stop() if what == "on" else broker.cont()
        else:
            if proxy is None:
                raise RuntimeError("slow fault without a proxy")
            proxy.slow(what == "on")
        if what == "on":
            starts[i] = before
        else:
            records.append(FaultRecord(f.kind, f.broker, starts[i], time.monotonic() - t0))
    tick(duration_s - done_s)
    records.sort(key=lambda r: r.start_s)
    return records


@dataclass
class ArmResult:
    arm: str
    repeat: int
    producers: int
    messages: int
    attempts: int
    failed_attempts: int
    exhausted: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    #: per fault: kind, broker, start/end s, bad attempts, producers that made one,
    #: s to the last bad attempt, s from the end to the first good send / half share
    faults: list[dict[str, Any]] = field(default_factory=list)
    #: bad attempts per 0.25 s bin (for the plot)
    bad_bins: list[int] = field(default_factory=list)
    #: sorted message send times, ms, at most 2,000 evenly spaced (for the CDF plot)
    latency_sample: list[float] = field(default_factory=list)
    other_bad: int = 0
    #: share (%) of the never-faulty brokers' fair traffic lost to false avoidance
    healthy_lost_pct: float = 0.0
    #: windows opened on never-faulty brokers (Detour's event log; None for the others)
    healthy_windows: int | None = None
    #: how long those windows kept their brokers avoided, summed (s)
    healthy_avoided_s: float | None = None


BIN_S = 0.25
#: Bins of the false-avoidance measure, s: long enough that round robin is even in each.
FAIR_BIN_S = 1.0


def healthy_lost(attempts: Sequence[tuple[float, float, int, bool, int]], healthy: Sequence[int],
                 duration_s: float) -> float:
    """The share (%) of the never-faulty brokers' fair traffic they did not get: per
    ``FAIR_BIN_S``, each one's shortfall of good sends below their mean, summed, over
    all their good sends. 0 when every healthy broker got its round-robin share; a window
    on a healthy broker (a send slowed by the machine, not the broker) shows here."""
    if not healthy:
        return 0.0
    bins = int(duration_s / FAIR_BIN_S) + 8
    good = [[0] * len(healthy) for _ in range(bins)]
    where = {b: i for i, b in enumerate(healthy)}
    for a in attempts:
        if a[2] in where and a[3] and a[1] * 1000 < SLOW_MS and a[0] >= 0:
            good[min(bins - 1, int(a[0] / FAIR_BIN_S))][where[a[2]]] += 1
    short = total = 0.0
    for row in good:
        mean = sum(row) / len(row)
        total += sum(row)
        short += sum(max(0.0, mean - x) for x in row)
    return 100.0 * short / total if total else 0.0


def analyse(arm: str, repeat: int, brokers: list[str], out: list[dict[str, Any]],
            faults: list[FaultRecord], duration_s: float) -> ArmResult:
    attempts = [(*a, o["index"]) for o in out for a in o["attempts"]]
    messages = [m for o in out for m in o["messages"]]
    attempts.sort()
    lat = sorted(m[1] * 1000 for m in messages)
    bins = [0] * (int(duration_s / BIN_S) + 8)
    fault_rows = []
    attributed = 0

    def is_bad(a: tuple[float, float, int, bool, int]) -> bool:
        return not a[3] or a[1] * 1000 >= SLOW_MS

    for a in attempts:
        if is_bad(a) and a[0] >= 0:
            bins[min(len(bins) - 1, int(a[0] / BIN_S))] += 1
    n = len(brokers)
    for f in faults:
        b = brokers.index(f.broker)
        # an attempt meets the fault when it overlaps it: one in flight at the kill counts
        on = [a for a in attempts if a[2] == b and a[0] <= f.end_s and a[0] + a[1] >= f.start_s]
        bad = [a for a in on if is_bad(a)]
        attributed += len(bad)
        after = [a for a in attempts if a[0] > f.end_s]
        first_good = next((a[0] for a in after if a[2] == b and not is_bad(a)), None)
        # half its fair share of the good sends, in a 0.25 s bin after the recovery
        share_at = None
        bin_good = bin_mine = 0
        bin_end = f.end_s + BIN_S
        for a in after:
            while a[0] >= bin_end:
                if bin_good >= 4 and bin_mine >= 0.5 * bin_good / n:
                    share_at = bin_end
                    break
                bin_good = bin_mine = 0
                bin_end += BIN_S
            if share_at is not None:
                break
            if not is_bad(a):
                bin_good += 1
                bin_mine += a[2] == b
        fault_rows.append({
            "kind": f.kind, "broker": f.broker, "start_s": round(f.start_s, 3),
            "end_s": round(f.end_s, 3), "bad": len(bad),
            "producers_hit": len({a[4] for a in bad}),
            "to_last_bad_s": round(max(a[0] for a in bad) - f.start_s, 3) if bad else None,
            "to_traffic_s": None if first_good is None else round(first_good - f.end_s, 3),
            "to_share_s": None if share_at is None else round(share_at - f.end_s, 3),
        })
    all_bad = sum(1 for a in attempts if is_bad(a))
    faulty = {brokers.index(f.broker) for f in faults}
    healthy = [i for i in range(n) if i not in faulty]
    step = max(1, len(lat) // 2000)
    return ArmResult(
        arm=arm, repeat=repeat, producers=len(out), messages=len(messages),
        attempts=len(attempts), failed_attempts=sum(1 for a in attempts if not a[3]),
        exhausted=sum(1 for m in messages if not m[3]),
        p50_ms=round(_pct(lat, 50), 2), p99_ms=round(_pct(lat, 99), 2),
        max_ms=round(lat[-1], 1) if lat else math.nan, faults=fault_rows,
        bad_bins=bins, latency_sample=[round(x, 3) for x in lat[::step]] + lat[-1:],
        other_bad=all_bad - attributed,
        healthy_lost_pct=round(healthy_lost(attempts, healthy, duration_s), 2),
    )


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    i = min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[i]


def run_arm(arm: str, repeat: int, producers: Producers, detour: str | None,
            args: argparse.Namespace, faults: Sequence[FaultSpec],
            tick: Callable[[float], None]) -> ArmResult:
    topic = f"efficacy-{arm}-{repeat}"
    extra = {**CACHED_ARMS.get(arm, ROCKETMQ), **args.config}
    config = scaled_config(args.scale, extra)
    slow = [f for f in faults if f.action == "slow"]
    with Fleet(args.brokers, topic, args.queues) as fleet:
        proxy = None
        if slow:
            proxy = DelayProxy(fleet.brokers[slow[0].broker].port, args.slow_ms)
        try:
            route = fleet.route()
            for b in route["brokers"]:
                if slow and b["brokerName"] == slow[0].broker and proxy is not None:
                    b["address"] = f"127.0.0.1:{proxy.port}"
            since: str | None = None
            if arm.startswith("detour"):
                assert detour is not None
                with httpx.Client(base_url=detour, timeout=5) as c:
                    c.patch("/config", json=config).raise_for_status()
                    c.put(f"/routes/{topic}", json=route).raise_for_status()
                    for name in fleet.brokers:  # windows left by the previous arm
                        c.delete(f"/fault-items/{name}")
                    # the arm's own events come after this one (the log outlives arms)
                    last = c.get("/events", params={"latest": "true", "limit": 1}).json()
                    since = last["events"][-1]["id"] if last["events"] else None
            job = Job(arm, topic, detour, route, config, args.rate, args.duration,
                      args.timeout, 2, 3.0, args.pending_factor, args.pending_floor_ms)
            records: list[FaultRecord] = []

            def on_go(t0: float) -> None:
                records.extend(run_faults(fleet, proxy, faults, t0, args.duration, tick))

            out = producers.run(job, on_go, timeout_s=30)
            events: list[dict[str, Any]] | None = None
            if arm.startswith("detour"):
                assert detour is not None  # the detour arms run with a service
                with httpx.Client(base_url=detour, timeout=5) as c:
                    params: dict[str, str | int] = {"limit": 1000}
                    if since:
                        params["since"] = since
                    events = c.get("/events", params=params).json()["events"]
                (args.out / f"events-{arm}-{repeat}.json").write_text(json.dumps(events))
        finally:
            if proxy is not None:
                proxy.stop()
    result = analyse(arm, repeat, list(fleet.brokers), out, records, args.duration)
    if events is not None:
        faulty = {f.broker for f in faults}
        # windows on brokers no fault touched: false avoidance (Detour's arms only)
        healthy = [e for e in events if e["brokerName"] not in faulty]
        result.healthy_windows = sum(1 for e in healthy if e["kind"] in ("opened", "quorum"))
        result.healthy_avoided_s = round(avoided_ms(healthy) / 1000, 3)
    return result


def avoided_ms(events: Sequence[dict[str, Any]]) -> int:
    """How long the events' windows kept their brokers avoided, summed: each window from
    its opening to its end as last moved, or to the event that ended it early."""
    total = 0
    open_at: dict[str, tuple[int, int]] = {}
    for e in events:
        b = e["brokerName"]
        if e["kind"] in ("opened", "quorum") and b not in open_at:
            open_at[b] = (e["at"], e["availableAt"])
        elif e["kind"] == "extended" and b in open_at:
            open_at[b] = (open_at[b][0], e["availableAt"])
        elif e["kind"] == "ended" and b in open_at:
            start, end = open_at.pop(b)
            total += max(0, min(end, e["at"]) - start)
    return total + sum(end - start for start, end in open_at.values())


# -- output ------------------------------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float:
    vs = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vs) if vs else math.nan


def summary(results: Sequence[ArmResult]) -> dict[str, dict[str, Any]]:
    """Per arm: medians over repeats, per fault kind and overall."""
    out: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(r.arm for r in results):
        rs = [r for r in results if r.arm == arm]
        kinds: dict[str, dict[str, Any]] = {}
        for kind in dict.fromkeys(f["kind"] for r in rs for f in r.faults):
            rows = [f for r in rs for f in r.faults if f["kind"] == kind]
            kinds[kind] = {
                "bad": _median([f["bad"] for f in rows]),
                "bad_runs": [f["bad"] for f in rows],
                "producers_hit": _median([f["producers_hit"] for f in rows]),
                "to_last_bad_s": _median([f["to_last_bad_s"] for f in rows]),
                "to_traffic_s": _median([f["to_traffic_s"] for f in rows]),
                "to_share_s": _median([f["to_share_s"] for f in rows]),
            }
        out[arm] = {
            "runs": len(rs),
            "messages": _median([r.messages for r in rs]),
            "attempts": _median([r.attempts for r in rs]),
            "failed_attempts": _median([r.failed_attempts for r in rs]),
            "failed_runs": [r.failed_attempts for r in rs],
            "exhausted": _median([r.exhausted for r in rs]),
            "p50_ms": _median([r.p50_ms for r in rs]),
            "p99_ms": _median([r.p99_ms for r in rs]),
            "max_ms": _median([r.max_ms for r in rs]),
            "other_bad": _median([r.other_bad for r in rs]),
            "healthy_lost_pct": _median([r.healthy_lost_pct for r in rs]),
            "healthy_windows": None if rs[0].healthy_windows is None
            else sum(r.healthy_windows or 0 for r in rs),
            "healthy_avoided_s": None if rs[0].healthy_avoided_s is None
            else round(sum(r.healthy_avoided_s or 0 for r in rs), 3),
            "kinds": kinds,
        }
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def markdown(results: Sequence[ArmResult], args: argparse.Namespace, command: str,
             wall_s: float) -> str:
    s = summary(results)
    kinds = list(dict.fromkeys(k for a in s.values() for k in a["kinds"]))
    runs = max(a["runs"] for a in s.values())
    lines = [
        f"{args.producers} producer processes x {args.rate:g} msg/s, {args.brokers} brokers x "
        f"{args.queues} queues, {args.duration:g} s per arm, faults `{args.faults}`, tiers' "
        f"windows / {args.scale:g}, attempt timeout {args.timeout:g} s, slow = +"
        f"{args.slow_ms:g} ms. Medians of {runs} run(s); wall time {wall_s:.0f} s.",
        "",
        "| strategy | messages | failed attempts | exhausted | p50 ms | p99 ms | max ms | "
        + " | ".join(f"bad on {k} broker (producers)" for k in kinds)
        + " | healthy brokers' fair share lost % | windows on healthy brokers "
        "(avoided s), all runs |",
        "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(kinds) + "---:|---:|",
    ]
    for arm, a in s.items():
        cells = []
        for k in kinds:
            kk = a["kinds"].get(k)
            cells.append("" if kk is None else
                         f"{_f(kk['bad'], '{:.0f}')} ({_f(kk['producers_hit'], '{:.0f}')})")
        lines.append(
            f"| {arm} | {a['messages']:,.0f} | {a['failed_attempts']:,.0f} | "
            f"{a['exhausted']:.0f} | {_f(a['p50_ms'])} | {_f(a['p99_ms'])} | "
            f"{_f(a['max_ms'], '{:.0f}')} | " + " | ".join(cells)
            + f" | {_f(a['healthy_lost_pct'])} | "
            + ("- |" if a["healthy_windows"] is None
               else f"{a['healthy_windows']} ({a['healthy_avoided_s']:.2f}) |"))
    lines += [
        "",
        "| strategy | " + " | ".join(
            f"{k}: to last bad s | {k}: back to first send s | {k}: back to half share s"
            for k in kinds) + " |",
        "|---|" + "---:|" * (3 * len(kinds)),
    ]
    for arm, a in s.items():
        cells = []
        for k in kinds:
            kk = a["kinds"].get(k, {})
            cells += [_f(kk.get("to_last_bad_s")), _f(kk.get("to_traffic_s")),
                      _f(kk.get("to_share_s"))]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    base = s.get("per-producer")
    if base is not None:
        lines += ["", "Ratio per-producer / strategy, bad attempts on the faulty broker:", "",
                  "| strategy | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
        for arm, a in s.items():
            if not arm.startswith("detour"):
                continue
            cells = []
            for k in kinds:
                mine = a["kinds"].get(k, {}).get("bad")
                theirs = base["kinds"].get(k, {}).get("bad")
                cells.append("-" if not mine or theirs is None else f"{theirs / mine:.1f}")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    if runs > 1:
        lines += ["", "Per run (bad attempts per fault kind, failed attempts):", ""]
        for arm, a in s.items():
            per = "; ".join(f"{k} {a['kinds'][k]['bad_runs']}" for k in a["kinds"])
            lines.append(f"- {arm}: {per}; failed {a['failed_runs']}")
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


COLORS = {"no-avoidance": "tab:gray", "per-producer": "tab:red",
          "detour-cached": "tab:blue", "detour-http": "tab:cyan", "detour-recover": "tab:green",
          "detour-pending": "tab:purple", "detour-all": "tab:red", "detour-default": "tab:olive"}
SHADE = {"crash": "tab:red", "hang": "tab:orange", "slow": "gold"}


def plot_timeline(results: Sequence[ArmResult], path: Path, duration_s: float) -> None:
    """Bad attempts per 0.25 s per strategy (first repeat), the faults shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = [r for r in results if r.repeat == 0]
    fig, axes = plt.subplots(len(first), 1, figsize=(9, 1.3 * len(first) + 0.8), sharex=True,
                             sharey=True)
    axes = list(axes) if len(first) > 1 else [axes]
    top = max(max(r.bad_bins) for r in first) or 1
    for ax, r in zip(axes, first, strict=True):
        xs = [i * BIN_S for i in range(len(r.bad_bins))]
        ax.bar(xs, r.bad_bins, width=BIN_S, align="edge", color=COLORS.get(r.arm, "black"))
        for f in r.faults:
            ax.axvspan(f["start_s"], f["end_s"], color=SHADE.get(f["kind"], "gray"), alpha=0.15,
                       linewidth=0)
        total = sum(f["bad"] for f in r.faults)
        ax.text(0.995, 0.9, f"{r.arm}: {total} bad attempts on faulty brokers",
                transform=ax.transAxes, ha="right", va="top", fontsize=8)
        ax.set_ylim(0, top * 1.15)
        ax.set_xlim(0, duration_s)
        ax.grid(True, axis="y", alpha=0.3)
    for f in first[0].faults:
        axes[0].text((f["start_s"] + f["end_s"]) / 2, top * 1.15, f"{f['kind']} {f['broker']}",
                     ha="center", va="bottom", fontsize=7)
    axes[-1].set_xlabel("seconds (windows scaled down)")
    fig.text(0.01, 0.5, "bad attempts per 0.25 s", rotation="vertical", va="center", fontsize=8)
    fig.tight_layout(rect=(0.02, 0, 1, 0.97))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_cdf(results: Sequence[ArmResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    for arm in dict.fromkeys(r.arm for r in results):
        r = next(x for x in results if x.arm == arm)
        ys = r.latency_sample
        if not ys:
            continue
        n = len(ys)
        ax.plot(ys, [1 - i / n for i in range(n)], label=arm, color=COLORS.get(arm, "black"),
                linewidth=1.3, drawstyle="steps-post")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message send time, ms (all attempts)")
    ax.set_ylabel("fraction of messages slower")
    ax.set_title("Real processes: message send time tail (1 - CDF)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# -- CLI ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.efficacy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--producers", type=int, default=16, help="producer processes (16)")
    p.add_argument("--rate", type=float, default=20.0, help="messages/s per producer (20)")
    p.add_argument("--brokers", type=int, default=8, help="stand-in brokers (8)")
    p.add_argument("--queues", type=int, default=2, help="write queues per broker (2)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per arm (30)")
    p.add_argument("--faults", default=DEFAULT_FAULTS, help="ACTION:BROKER@AT+HOLD, comma list")
    p.add_argument("--scale", type=float, default=40.0,
                   help="divide every avoidance window by this (40: 600 s -> 15 s)")
    p.add_argument("--timeout", type=float, default=1.0, help="per-attempt send timeout, s (1)")
    p.add_argument("--slow-ms", type=float, default=600.0, help="delay of the slow broker (600)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--repeats", type=int, default=1, help="runs of every arm (1)")
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--img", type=Path, default=None, help="write the plots here too")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--pending-factor", type=float, default=4.0,
                   help="SDK in-flight signals: k x the broker's p99 (4; the SDK's default)")
    p.add_argument("--pending-floor-ms", type=float, default=50.0,
                   help="SDK in-flight signals: the threshold's floor, ms (50)")
    p.add_argument("--config", type=json.loads, default={},
                   help='extra Config fields (JSON) for every arm, e.g. \'{"latencyQuorum": 2}\'')
    args = p.parse_args(argv)
    args.arm_list = [a for a in args.arms.split(",") if a]
    if set(args.arm_list) - set(ARMS):
        p.error(f"unknown arms: {sorted(set(args.arm_list) - set(ARMS))}")
    if not (1 <= args.producers <= 64 and 0 < args.rate <= 200 and args.repeats >= 1
            and 2 <= args.brokers <= 26 and args.duration > 0):
        p.error("--producers 1..64, --rate 0..200, --brokers 2..26, --repeats >= 1")
    try:
        from detour.model import Config

        Config.from_wire(scaled_config(args.scale, args.config))
    except (TypeError, ValueError) as exc:
        p.error(f"--config: {exc}")
    try:
        args.fault_list = [FaultSpec.parse(x) for x in args.faults.split(",") if x.strip()]
    except ValueError as exc:
        p.error(str(exc))
    if not args.fault_list or sum(f.action == "slow" for f in args.fault_list) > 1:
        p.error("at least one fault, at most one slow broker")
    return args


def run(args: argparse.Namespace) -> tuple[list[ArmResult], float]:
    """Every arm, ``args.repeats`` times, interleaved; returns the results and the wall time."""
    from tests.procs import RedisServer, ServiceProcess

    started = time.monotonic()
    # Fork the producers first, while this process has no thread.
    producers = Producers(args.producers)
    store = svc = None
    results: list[ArmResult] = []
    try:
        if any(a.startswith("detour") for a in args.arm_list):
            store = RedisServer()
            args.out.mkdir(parents=True, exist_ok=True)
            svc = ServiceProcess(redis_url=store.url, log_path=args.out / "efficacy-detour.log")
        from tqdm import tqdm

        show = not args.no_progress and sys.stderr.isatty()
        total = args.duration * len(args.arm_list) * args.repeats
        with tqdm(total=round(total), unit="s", disable=not show, file=sys.stderr,
                  desc="efficacy", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}") \
                as bar:
            for rep in range(args.repeats):
                for arm in args.arm_list:
                    bar.set_postfix_str(f"{arm} #{rep + 1}")
                    r = run_arm(arm, rep, producers, None if svc is None else svc.url, args,
                                args.fault_list, lambda s: bar.update(s))
                    results.append(r)
                    if not show:
                        print(f"{arm} #{rep + 1}: failed {r.failed_attempts}, bad per fault "
                              f"{[f['bad'] for f in r.faults]}", file=sys.stderr, flush=True)
    finally:
        producers.close()
        if svc is not None:
            svc.stop()
        if store is not None:
            store.stop()
    return results, time.monotonic() - started


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["_proxy"]:
        asyncio.run(_proxy(int(raw[1]), int(raw[2]), float(raw[3]) / 1000))
        return 0
    args = parse_args(raw)
    command = " ".join(["python -m bench.efficacy", *raw])
    results, wall = run(args)
    md = markdown(results, args, command, wall)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "efficacy.json").write_text(json.dumps({
        "command": command, "wall_s": round(wall, 1),
        "machine": {"nproc": os.cpu_count(), "python": platform.python_version()},
        "config": scaled_config(args.scale, args.config), "summary": summary(results),
        "results": [asdict(r) for r in results],
    }, indent=1))
    (args.out / "efficacy.md").write_text(md)
    for d in [args.out] + ([args.img] if args.img else []):
        d.mkdir(parents=True, exist_ok=True)
        plot_timeline(results, d / "efficacy-timeline.png", args.duration)
        plot_cdf(results, d / "efficacy-latency-cdf.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
