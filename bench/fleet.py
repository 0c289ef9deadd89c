"""``python -m bench.fleet``: what one redis-server spends on a fleet of Detour replicas,
measured as the replica count grows, and projected to 10,000 sidecars x 1,000 sends/s.

Why: at fleet scale a namespace lives on one Redis core (all its keys share one hash slot),
so the question is which fleet that core can carry. This bench measures the per-unit
costs on a real ``redis-server`` and projects from them; docs/BENCHMARKS.md "Fleet scale"
holds the figures.

One ``redis-server`` on a free 127.0.0.1 port. Each simulated replica holds two real
connections, as a ``python -m service`` on Redis does:

* a **subscription** to the namespace's change channel (``SUBSCRIBE``): it receives every
  window pushed;
* a **command connection** that sends the version poll (the store's own ``poll.lua``, by
  ``EVALSHA``, the replica's own id) every ``--sync-interval-s`` and the periodic
  **flush** of what it summed locally every ``--flush-interval-s``: one call of the real
  ``report.lua`` (ARGV from the store's own ``_report_args``; the replica as the writer,
  its next sequence numbers) with one entry per broker for ``--flush-brokers`` brokers.
  When ``report.lua`` takes summary entries (isolation "s": latest latency and a
  histogram of ``--flush-buckets`` counts), those are sent; before, the same brokers as
  reports that change no window (each a latency-log entry, as a summary is).

One real ``RedisStore`` (the service's own store code, ``report.lua`` through
``report_many``) is the replica that reports: isolations of new brokers that open a window
(each a ``PUBLISH`` fanned out to every subscription), and, for the design that writes one
report per send, latency reports that change no window.

For each replica count, in order, after the fleet has grown to it (phases of
``--phase-s`` each): nothing (the connections' idle cost), polls only, flushes only,
window pushes only (``--push-rate`` per s), reports that change nothing (back to back), and
a mixed load (polls + flushes + ``--mixed-faults`` windows per s). Measured per phase:
Redis CPU (``INFO cpu``, user + sys), the command rate (``INFO stats``
``total_commands_processed``: every command a script runs counts), the machine's idle CPU
(``/proc/stat``: the machine is shared), and for every push: the fan-out time (first to
last subscription receiving it) and the propagation time (the report sent to each
subscription receiving it). The simulated replicas' receiving side is one Python process
on the same machine: the times include its event loop's delay, so they are upper bounds.

Per-unit costs (Redis CPU µs) come from the phases over the idle phase: per poll, per
flush, per report that changes nothing, and per window push as a line over the replica
count (intercept: the report script; slope: one subscription's delivery). The projection
adds them up; the mixed phase checks it against a measurement. ``--runs`` fresh
redis-servers; medians across runs. Writes ``fleet.json`` and ``fleet.md`` under ``--out``
and the plot to ``--plot``.

    python -m bench.fleet [--runs 3] [--replicas 10,100,300,1000,2000] [--quick]

With ``--redis-replicas 0,1,2 [--subscriptions 4000]`` it measures the fan-out tier instead:
one primary and that many Redis replicas, the sidecars reading from the replicas
(bench/fleet_tier.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import re
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import sha1
from pathlib import Path
from typing import Any

from service.settings import Settings
from service.store import scripts
from service.store.base import ReportIn
from service.store.redis import RedisStore, integrity_arg
from tests.procs import ROOT, RedisServer

OUT = ROOT / "bench" / "out"
PLOT = ROOT / "docs" / "img" / "fleet-scale.png"
TIER_PLOT = ROOT / "docs" / "img" / "fleet-tier.png"
LUA = ROOT / "service" / "store" / "lua"
#: a pushed change names its broker ({"k":"fault","v":..,"f":broker,"x":..})
#: report.lua takes summary entries (a replica's quiet reports summed between flushes)
SUMMARIES = "== 's'" in (LUA / "report.lua").read_text()
#: report.lua's ARGV: the head's length, then values per report (as the script reads them)
_FIRST = re.search(r"local FIRST, STRIDE = (\d+), (\d+)", (LUA / "report.lua").read_text())
assert _FIRST is not None, "report.lua no longer says where its entries start"
HEAD, STRIDE = int(_FIRST[1]) - 1, int(_FIRST[2])
BROKER_IN_PUSH = re.compile(rb'"f":"([^"]+)"')
#: the sidecars and sends of the projection's target
SIDECARS = (100, 300, 1_000, 3_000, 10_000)
SENDS_PER_S = 1_000
FAULT_RATES = (0, 1, 10, 100)
#: a longer flush interval the projection also shows (the flushes dominate at fleet scale)
LONG_FLUSH_S = 10.0


def resp(*parts: object) -> bytes:
    """One command in RESP (what a Redis client writes)."""
    out = [f"*{len(parts)}\r\n".encode()]
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def raise_file_limit(needed: int) -> int:
    """Raise this process's open-file limit (inherited by redis-server) to ``needed``, as far
    as the hard limit allows; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return max(soft, want)


def machine_cpu() -> tuple[int, int]:
    """(idle, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)


class Subscription(asyncio.Protocol):
    """One replica's subscription: the monotonic time each pushed broker arrived."""

    def __init__(self, channel: str) -> None:
        self.channel = channel
        self.seen: dict[bytes, float] = {}
        self.ready = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(resp("SUBSCRIBE", self.channel))

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self.ready.done() and b"subscribe" in data:
            self.ready.set_result(None)
        for broker in BROKER_IN_PUSH.findall(data):
            self.seen.setdefault(broker, now)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_exception(ConnectionError("subscription closed"))


class Commands(asyncio.Protocol):
    """One replica's command connection: replies are read and dropped, errors counted."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.errors = 0
        self.received = 0
        #: the echo awaited by ``drain`` (replies come in order: every command before it
        #: has been answered when it arrives), the last bytes kept for one split in two
        self._token = b""
        self._tail = b""
        self._drained: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        # an error reply starts a line with "-" (no reply of these commands carries one); a
        # report.lua that refused to write answers six elements, a negative status first
        if data.startswith((b"-", b"*6\r\n:-")) or b"\r\n-" in data or b"\n*6\r\n:-" in data:
            self.errors += 1
        if self._drained is not None and not self._drained.done():
            seen = self._tail + data
            if self._token in seen:
                self._drained.set_result(None)
            self._tail = seen[-len(self._token) :]

    def drain(self, token: bytes) -> asyncio.Future[None]:
        """Send an ECHO of ``token``; the future is done once its reply arrived."""
        self._token, self._tail = token, b""
        self._drained = asyncio.get_running_loop().create_future()
        self.send(resp("ECHO", token))
        return self._drained

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)


@dataclass
class Replica:
    """A simulated replica: its subscription, its command connection and its payloads."""

    #: None when the subscriptions are bench/receiver.c's (bench.fleet_tier)
    sub: Subscription | None
    cmd: Commands
    poll: bytes
    flush: Flush


@dataclass
class Keys:
    """The namespace's keys and channel, taken from the real store."""

    meta: str
    writers: str
    channel: str
    #: the latency log (a flush adds one entry per broker)
    log: str


class Flush:
    """One replica's flush as the real report.lua call: one entry per broker, this replica
    as the writer and its next sequence number each time (so the script does the
    applied-once bookkeeping it does for a real flush).

    With report.lua's summary entries (isolation "s": a replica's quiet reports summed per
    broker, latest latency and histogram) the entry is a summary of ``buckets`` counts;
    before them, the same brokers as reports that change no window (each one a latency-log
    entry, as a summary is)."""

    def __init__(
        self, store: RedisStore, keys: list[str], replica: str, brokers: int, buckets: int
    ) -> None:
        self.seq = 0
        self.sha = store._scripts["report"].sha
        self.keys = keys
        names = [f"broker-{b:03d}" for b in range(brokers)]
        reports = [ReportIn(n, 40 + b, seq=1) for b, n in enumerate(names)]
        args, _ = store._report_args(reports, store.view.config)
        args[7] = replica  # ARGV[8]: the writer
        args[8] = integrity_arg(0)  # ARGV[9]: a new writer has seen nothing applied yet
        head = args[:HEAD]
        if SUMMARIES:
            counts = ",".join(str(7 * (k + 1)) for k in range(buckets))
            body: list[object] = []
            for b, n in enumerate(names):
                body += [n, 40 + b, 1000, 0, "s", counts, 0, 0, "", "", 1, "", "", ""]
        else:
            body = args[HEAD:]
        self.head, self.body = head, body

    def command(self) -> bytes:
        body = list(self.body)
        for i in range(10, len(body), STRIDE):  # each entry's sequence number
            self.seq += 1
            body[i] = self.seq
        return resp("EVALSHA", self.sha, len(self.keys), *self.keys, *self.head, *body)


@dataclass
class Phase:
    """What Redis and the machine did during one phase."""

    name: str
    seconds: float
    redis_cpu_s: float
    commands: int
    units: int
    machine_idle: float
    #: entries added to the latency log (a flush adds one per broker)
    log_entries: int = 0
    fanout_ms: list[float] = field(default_factory=list)
    propagation_ms: list[float] = field(default_factory=list)
    delivered: float = math.nan

    def row(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "redis_cpu_s": self.redis_cpu_s,
            "redis_cpu_share": self.redis_cpu_s / self.seconds,
            "commands_per_s": self.commands / self.seconds,
            "units": self.units,
            "machine_idle": self.machine_idle,
            "log_entries": self.log_entries,
            "fanout_p50_ms": _pct(self.fanout_ms, 50),
            "fanout_p99_ms": _pct(self.fanout_ms, 99),
            "propagation_p50_ms": _pct(self.propagation_ms, 50),
            "propagation_p99_ms": _pct(self.propagation_ms, 99),
            "delivered": self.delivered,
        }


def _pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


@dataclass
class Options:
    replicas: list[int]
    runs: int
    phase_s: float
    sync_interval_s: float
    flush_interval_s: float
    flush_brokers: int
    flush_buckets: int
    push_rate: float
    mixed_faults: float


class Fleet:
    """One redis-server, the reporting store, and the simulated replicas on it."""

    def __init__(self, server: RedisServer, store: RedisStore, opts: Options) -> None:
        self.server = server
        self.store = store
        self.opts = opts
        self.info = server.client()
        self.keys = Keys(store._meta, store._writers, store._channel, store._log)
        # report.lua's KEYS, in the order RedisStore._report_remote passes them
        self.report_keys = list(store._report_keys())
        self.poll_sha = sha1(scripts.source("poll").encode()).hexdigest()
        # the poll the replicas send is the store's own script, not a copy
        assert self.poll_sha == store._scripts["poll"].sha, "poll.lua is not the store's"
        self.replicas: list[Replica] = []
        self.pushed = 0
        self.drains = 0
        #: reports the store answered degraded (journaled, not counted as Redis work)
        self.degraded = 0

    async def grow(self, n: int) -> None:
        """Open replicas up to ``n``; returns once every subscription is confirmed."""
        loop = asyncio.get_running_loop()
        opts, keys = self.opts, self.keys
        while len(self.replicas) < n:
            batch = []
            for i in range(len(self.replicas), min(n, len(self.replicas) + 200)):
                rid = f"fleet-{i}"
                _, sub = await loop.create_connection(
                    lambda: Subscription(keys.channel), "127.0.0.1", self.server.port
                )
                _, cmd = await loop.create_connection(Commands, "127.0.0.1", self.server.port)
                # (the lineage pair of a replica that reached none: nothing to check)
                poll = resp("EVALSHA", self.poll_sha, 2, keys.meta, keys.writers, rid, 0, "")
                flush = Flush(
                    self.store, self.report_keys, rid, opts.flush_brokers, opts.flush_buckets
                )
                batch.append(Replica(sub, cmd, poll, flush))
            await asyncio.gather(*(r.sub.ready for r in batch if r.sub is not None))
            self.replicas += batch

    def close(self) -> None:
        for r in self.replicas:
            for t in (r.sub.transport if r.sub else None, r.cmd.transport):
                if t is not None:
                    t.close()
        self.info.close()

    def redis_counters(self) -> tuple[float, int]:
        """(Redis CPU s, commands processed) so far."""
        cpu = self.info.info("cpu")
        stats = self.info.info("stats")
        return (
            float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            int(stats["total_commands_processed"]),
        )

    def log_added(self) -> int:
        """Entries ever added to the latency log (trimming does not lower it)."""
        return int(self.info.xinfo_stream(self.keys.log)["entries-added"])

    async def drain(self) -> None:
        """Wait (bounded) until every command connection has its replies."""
        self.drains += 1
        token = f"drained-{self.drains}".encode()
        await asyncio.wait_for(asyncio.gather(*(r.cmd.drain(token) for r in self.replicas)), 30)

    async def _spread(self, interval_s: float, pick: str, end: float, start: float) -> int:
        """Each replica sends its ``pick`` payload once per ``interval_s``, the replicas
        spread evenly over the interval; returns how many were sent."""
        n = len(self.replicas)
        sent = 0
        while (now := time.perf_counter()) < end:
            due = int((now - start) * n / interval_s)
            while sent < due:
                r = self.replicas[sent % n]
                r.cmd.send(r.poll if pick == "poll" else r.flush.command())
                sent += 1
            await asyncio.sleep(0.005)
        return sent

    async def _push(self, rate: float, end: float, start: float) -> dict[bytes, float]:
        """Open ``rate`` windows per s through the real store; the send time of each."""
        sent: dict[bytes, float] = {}
        k = 0
        while time.perf_counter() < end:
            due = start + k / rate
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            self.pushed += 1
            broker = f"window-{self.pushed}"
            t0 = time.perf_counter()
            out = await self.store.report_many([ReportIn(broker, 0, isolation=True)])
            k += 1
            if out[0].degraded:
                await self._settle()
                continue
            assert out[0].change == 1, f"no window opened: {out[0]}"
            sent[broker.encode()] = t0
        return sent

    async def _fast(self, end: float) -> int:
        """Reports that change no window, back to back: the per-send write of today."""
        n = 0
        while time.perf_counter() < end:
            out = await self.store.report_many([ReportIn("steady", 10)])
            if out[0].degraded:
                await self._settle()
                continue
            assert out[0].change == 0, out[0]
            n += 1
        return n

    async def _settle(self) -> None:
        """The reporting store went degraded (it re-syncs, its journal took the report):
        counted, and waited out (bounded) so the next reports reach Redis again."""
        self.degraded += 1
        deadline = time.perf_counter() + 30
        while self.store.degraded and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        if self.store.degraded:
            raise RuntimeError("the reporting store stayed degraded for 30 s")

    async def phase(self, name: str) -> Phase:
        opts = self.opts
        if self.store.degraded:
            await self._settle()
        await asyncio.sleep(0.05)  # let the previous phase's replies drain
        idle0, total0 = machine_cpu()
        cpu0, cmd0 = self.redis_counters()
        log0 = self.log_added()
        start = time.perf_counter()
        end = start + opts.phase_s
        units = 0
        sent: dict[bytes, float] = {}
        if name == "idle":
            await asyncio.sleep(opts.phase_s)
        elif name == "poll":
            units = await self._spread(opts.sync_interval_s, "poll", end, start)
        elif name == "flush":
            units = await self._spread(opts.flush_interval_s, "flush", end, start)
        elif name == "push":
            sent = await self._push(opts.push_rate, end, start)
            units = len(sent)
        elif name == "fast":
            units = await self._fast(end)
        elif name == "mixed":
            _, _, sent = await asyncio.gather(
                self._spread(opts.sync_interval_s, "poll", end, start),
                self._spread(opts.flush_interval_s, "flush", end, start),
                self._push(opts.mixed_faults, end, start),
            )
            units = len(sent)
        else:
            raise ValueError(name)
        elapsed = time.perf_counter() - start
        await asyncio.sleep(0.05)  # the last sends' replies
        cpu1, cmd1 = self.redis_counters()
        # (what is still in flight is left out of the CPU, not of the log: the test checks
        # every flush was logged)
        await self.drain()
        log1 = self.log_added()
        idle1, total1 = machine_cpu()
        result = Phase(
            name,
            elapsed,
            cpu1 - cpu0,
            cmd1 - cmd0,
            units,
            (idle1 - idle0) / max(1, total1 - total0),
            log1 - log0,
        )
        if sent:
            await self._deliveries(sent, result)
        return result

    async def _deliveries(self, sent: dict[bytes, float], result: Phase) -> None:
        """Wait (bounded) for every subscription to receive every push; fan-out and
        propagation times of what arrived."""
        subs = [r.sub for r in self.replicas if r.sub is not None]
        deadline = time.perf_counter() + 10
        while time.perf_counter() < deadline and not all(
            all(b in s.seen for b in sent) for s in subs
        ):
            await asyncio.sleep(0.02)
        got = 0
        for broker, t0 in sent.items():
            times = [s.seen[broker] for s in subs if broker in s.seen]
            got += len(times)
            if times:
                result.fanout_ms.append((max(times) - min(times)) * 1000)
                result.propagation_ms += [(t - t0) * 1000 for t in times]
        result.delivered = got / (len(sent) * len(subs))
        for s in subs:
            for broker in sent:
                s.seen.pop(broker, None)

    def errors(self) -> int:
        return sum(r.cmd.errors for r in self.replicas)


PHASES = ("idle", "poll", "flush", "push", "fast", "mixed")
#: per run: reports the reporting store answered degraded (left out of the figures)
DEGRADED: list[int] = []


async def one_run(opts: Options) -> dict[int, dict[str, Phase]]:
    """One fresh redis-server, the fleet grown through ``opts.replicas``."""
    server = RedisServer(extra=["--maxclients", str(2 * max(opts.replicas) + 64)])
    # A generous call timeout: on a busy machine the report must reach Redis, not the
    # journal (a journaled report costs Redis nothing and would be counted as free).
    store = RedisStore(
        Settings(
            redis_url=server.url,
            sync_interval_s=opts.sync_interval_s,
            redis_timeout_s=10,
            redis_call_timeout_s=10,
            # This store stands for the design the flushes replace (the "fast" phase: a
            # script per send); the flushes themselves are the simulated replicas'.
            report_flush_ms=0,
        )
    )
    fleet: Fleet | None = None
    out: dict[int, dict[str, Phase]] = {}
    try:
        await store.start()
        await asyncio.wait_for(store.synced.wait(), 30)
        # the table's first write gives it its epoch, which the flushes then carry
        await store.report_many([ReportIn("steady", 10)])
        fleet = Fleet(server, store, opts)
        for n in opts.replicas:
            await fleet.grow(n)
            out[n] = {name: await fleet.phase(name) for name in PHASES}
        if store.degraded:
            await fleet._settle()
        DEGRADED.append(fleet.degraded)
        if store.journal_size:
            raise RuntimeError(f"{store.journal_size} reports went to the journal, not Redis")
        if fleet.errors():
            raise RuntimeError(f"{fleet.errors()} error replies on the command connections")
    finally:
        if fleet is not None:
            fleet.close()
        await store.close()
        server.stop()
    return out


def unit_costs(phases: dict[str, Phase], n: int) -> dict[str, float]:
    """Redis CPU µs per unit at ``n`` replicas, the idle phase's rate taken off."""
    idle = phases["idle"]
    idle_rate = idle.redis_cpu_s / idle.seconds

    def over_idle(p: Phase) -> float:
        return max(0.0, p.redis_cpu_s - idle_rate * p.seconds) * 1e6 / max(1, p.units)

    return {
        "idle_us_per_conn_s": idle_rate * 1e6 / (2 * n),
        "poll_us": over_idle(phases["poll"]),
        "flush_us": over_idle(phases["flush"]),
        "push_us": over_idle(phases["push"]),
        "fast_report_us": over_idle(phases["fast"]),
    }


def line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


@dataclass
class Model:
    """Redis CPU per second as a sum of the measured per-unit costs."""

    conn_us_s: float
    poll_us: float
    flush_us: float
    report_us: float
    per_sub_us: float
    fast_report_us: float
    sync_interval_s: float
    flush_interval_s: float

    def cores(self, sidecars: float, faults_per_s: float, per_send: float = 0.0) -> float:
        """Redis cores busy for ``sidecars`` replicas with ``faults_per_s`` windows opened
        per s in the namespace; ``per_send``: reports per s written one by one (today's
        design) instead of flushed."""
        us = (
            2 * sidecars * self.conn_us_s
            + sidecars / self.sync_interval_s * self.poll_us
            + faults_per_s * (self.report_us + sidecars * self.per_sub_us)
        )
        us += (
            per_send * self.fast_report_us
            if per_send
            else (sidecars / self.flush_interval_s * self.flush_us)
        )
        return us / 1e6

    def max_faults(self, sidecars: float, budget: float = 0.8) -> float:
        """Windows per s one Redis core carries at ``budget`` of a core."""
        left = budget - self.cores(sidecars, 0)
        return max(0.0, left * 1e6 / (self.report_us + sidecars * self.per_sub_us))


def summarise(runs: list[dict[int, dict[str, Phase]]], opts: Options) -> dict[str, Any]:
    """Medians across runs per replica count; the model from the medians."""
    per_n: dict[int, dict[str, Any]] = {}
    for n in opts.replicas:
        rows = {name: [r[n][name].row() for r in runs] for name in PHASES}
        costs = [unit_costs(r[n], n) for r in runs]
        per_n[n] = {
            "phases": {
                name: {k: statistics.median(row[k] for row in rs) for k in rs[0]}
                for name, rs in rows.items()
            },
            "costs": {k: statistics.median(c[k] for c in costs) for k in costs[0]},
        }
    ns = opts.replicas
    # Per-unit costs as lines over the replica count: what grows with the replicas is the
    # cost per unit (the slope); the rest (serverCron, the reporting store's own polls,
    # the INFO calls) is the intercept, so small counts do not drown in it.
    med = {n: per_n[n]["phases"] for n in ns}
    _, conn_slope = line([2 * n for n in ns], [med[n]["idle"]["redis_cpu_share"] for n in ns])

    def over_idle_rate(name: str) -> list[float]:
        return [med[n][name]["redis_cpu_share"] - med[n]["idle"]["redis_cpu_share"] for n in ns]

    _, poll_slope = line(ns, over_idle_rate("poll"))
    _, flush_slope = line(ns, over_idle_rate("flush"))
    # The slope is one delivery; the script is the smallest count's cost without its
    # deliveries (the intercept of the line would carry the large counts' noise).
    _, per_sub_us = line(ns, [per_n[n]["costs"]["push_us"] for n in ns])
    report_us = per_n[ns[0]]["costs"]["push_us"] - ns[0] * max(0.0, per_sub_us)
    model = Model(
        conn_us_s=max(0.0, conn_slope * 1e6),
        poll_us=max(0.0, poll_slope * 1e6 * opts.sync_interval_s),
        flush_us=max(0.0, flush_slope * 1e6 * opts.flush_interval_s),
        report_us=max(0.0, report_us),
        per_sub_us=max(0.0, per_sub_us),
        fast_report_us=statistics.median(per_n[n]["costs"]["fast_report_us"] for n in ns),
        sync_interval_s=opts.sync_interval_s,
        flush_interval_s=opts.flush_interval_s,
    )
    for n in ns:
        # the idle phase measured (it holds the connections and the fixed part) + the rest
        per_n[n]["mixed_model_cores"] = (
            med[n]["idle"]["redis_cpu_share"]
            + model.cores(n, opts.mixed_faults)
            - 2 * n * model.conn_us_s / 1e6
        )
    long = dataclasses.replace(model, flush_interval_s=LONG_FLUSH_S)
    projection = [
        {
            "sidecars": s,
            "cores": {str(f): model.cores(s, f) for f in FAULT_RATES},
            "max_faults_per_s": model.max_faults(s),
            "long_flush_cores": long.cores(s, 0),
            "long_flush_max_faults_per_s": long.max_faults(s),
            "per_send_cores": model.cores(s, 0, per_send=s * SENDS_PER_S),
        }
        for s in SIDECARS
    ]
    return {
        "options": vars(opts),
        "replicas": {str(n): v for n, v in per_n.items()},
        "model": vars(model),
        "projection": projection,
        "load": os.getloadavg(),
        "degraded_reports": list(DEGRADED),
    }


def markdown(result: dict[str, Any]) -> str:
    o, m = result["options"], result["model"]
    lines = [
        f"Measured ({o['runs']} runs, medians; phases of {o['phase_s']} s; polls every "
        f"{o['sync_interval_s']} s, flushes every {o['flush_interval_s']} s of "
        f"{o['flush_brokers']} brokers x {o['flush_buckets']} buckets; pushes at "
        f"{o['push_rate']}/s; mixed: polls + flushes + {o['mixed_faults']} windows/s):",
        "",
        "| replicas | connections | machine idle | Redis CPU: idle | Redis CPU: polls "
        "| Redis CPU: flushes | mixed: Redis CPU (model) | mixed: commands/s "
        "| pushes: fan-out p50 / p99 ms | pushes: propagation p99 ms | pushes delivered |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, v in result["replicas"].items():
        ph = v["phases"]
        mx = ph["mixed"]
        lines.append(
            f"| {int(n):,} | {2 * int(n):,} | {mx['machine_idle']:.0%} "
            f"| {ph['idle']['redis_cpu_share']:.1%} | {ph['poll']['redis_cpu_share']:.1%} "
            f"| {ph['flush']['redis_cpu_share']:.1%} "
            f"| {mx['redis_cpu_share']:.1%} ({v['mixed_model_cores']:.1%}) "
            f"| {mx['commands_per_s']:,.0f} "
            f"| {ph['push']['fanout_p50_ms']:.1f} / {ph['push']['fanout_p99_ms']:.1f} "
            f"| {ph['push']['propagation_p99_ms']:.1f} | {ph['push']['delivered']:.0%} |"
        )
    load = ", ".join(f"{x:.1f}" for x in result["load"])
    lines += [
        "",
        f"Load average at the end: {load} (the machine's idle CPU is beside each row); "
        f"reports the reporting store answered degraded, per run (left out): "
        f"{result['degraded_reports']}.",
        "",
        "Per-unit Redis CPU (µs): "
        f"poll {m['poll_us']:.1f}, flush {m['flush_us']:.1f}, window report script "
        f"{m['report_us']:.1f} + {m['per_sub_us']:.2f} per subscription it is pushed to, "
        f"report that changes nothing (today's per-send write) {m['fast_report_us']:.1f}, "
        f"an idle connection {m['conn_us_s']:.2f} µs/s.",
        "",
        f"Projected Redis cores for one namespace ({SENDS_PER_S:,} sends/s per sidecar):",
        "",
        "| sidecars | "
        + " | ".join(f"{f} windows/s" for f in FAULT_RATES)
        + f" | windows/s at 0.8 core | flushes every {LONG_FLUSH_S:g} s: 0 windows/s "
        f"| flushes every {LONG_FLUSH_S:g} s: windows/s at 0.8 core | a report per send (today) |",
        "|---:|" + "---:|" * (len(FAULT_RATES) + 4),
    ]
    for p in result["projection"]:
        lines.append(
            f"| {p['sidecars']:,} | "
            + " | ".join(f"{c:.2f}" for c in p["cores"].values())
            + f" | {p['max_faults_per_s']:,.0f} | {p['long_flush_cores']:.2f} "
            f"| {p['long_flush_max_faults_per_s']:,.0f} | {p['per_send_cores']:,.0f} |"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Projected Redis cores against sidecars, per fault rate, with the measured points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = Model(**result["model"])
    xs = [10 * 10 ** (k / 20) for k in range(61)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for f in FAULT_RATES:
        ax.plot(xs, [m.cores(x, f) for x in xs], label=f"{f} windows/s")
    ax.plot(
        xs,
        [m.cores(x, 0, per_send=x * SENDS_PER_S) for x in xs],
        "k--",
        label=f"a report per send ({SENDS_PER_S:,}/s each)",
    )
    long = dataclasses.replace(m, flush_interval_s=LONG_FLUSH_S)
    ax.plot(
        xs,
        [long.cores(x, 0) for x in xs],
        ":",
        color="C0",
        label=f"0 windows/s, flushes every {LONG_FLUSH_S:g} s",
    )
    mixed = result["options"]["mixed_faults"]
    pts = [(int(n), v["phases"]["mixed"]["redis_cpu_share"]) for n, v in result["replicas"].items()]
    ax.plot(
        [p[0] for p in pts],
        [p[1] for p in pts],
        "o",
        color="C3",
        label=f"measured, {mixed:g} windows/s",
    )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(1e-4, 1e3)
    ax.set_xlabel("sidecars (replicas) in one namespace")
    ax.set_ylabel("Redis cores busy")
    ax.set_title("One Redis namespace: projected from measured per-unit costs")
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--replicas",
        default="10,100,300,1000,2000",
        help="replica counts, comma-separated, ascending",
    )
    p.add_argument("--runs", type=int, default=3, choices=range(1, 11), metavar="1..10")
    p.add_argument("--phase-s", type=float, default=1.5)
    p.add_argument("--sync-interval-s", type=float, default=1.0)
    p.add_argument("--flush-interval-s", type=float, default=1.0)
    p.add_argument("--flush-brokers", type=int, default=16)
    p.add_argument("--flush-buckets", type=int, default=8)
    p.add_argument("--push-rate", type=float, default=10.0)
    p.add_argument("--mixed-faults", type=float, default=5.0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="10 and 50 replicas, one run, short phases (the test's mode)",
    )
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--plot", type=Path, default=PLOT)
    p.add_argument(
        "--redis-replicas",
        default="",
        help="the fan-out tier instead (bench/fleet_tier.py): Redis replica counts, "
        "comma-separated (e.g. 0,1,2), each run with --subscriptions sidecars",
    )
    p.add_argument("--subscriptions", type=int, default=4000)
    args = p.parse_args(argv)
    if args.redis_replicas:
        from bench import fleet_tier

        counts = sorted({int(x) for x in args.redis_replicas.split(",")})
        n = 50 if args.quick else args.subscriptions
        limit = raise_file_limit(3 * n + 256)
        if limit < 3 * n + 128:
            p.error(f"the open-file limit ({limit}) is too low for {n} subscriptions")
        tier_opts = Options(
            replicas=[n],
            runs=1 if args.quick else args.runs,
            phase_s=0.5 if args.quick else args.phase_s,
            sync_interval_s=args.sync_interval_s,
            flush_interval_s=args.flush_interval_s,
            flush_brokers=args.flush_brokers,
            flush_buckets=args.flush_buckets,
            push_rate=args.push_rate,
            mixed_faults=args.mixed_faults,
        )
        plot_path = args.plot if args.plot != PLOT else TIER_PLOT
        return fleet_tier.main_tier(tier_opts, counts, n, args.out, plot_path)
    replicas = [10, 50] if args.quick else sorted({int(x) for x in args.replicas.split(",")})
    opts = Options(
        replicas=replicas,
        runs=1 if args.quick else args.runs,
        phase_s=0.5 if args.quick else args.phase_s,
        sync_interval_s=args.sync_interval_s,
        flush_interval_s=args.flush_interval_s,
        flush_brokers=args.flush_brokers,
        flush_buckets=args.flush_buckets,
        push_rate=args.push_rate,
        mixed_faults=args.mixed_faults,
    )
    limit = raise_file_limit(2 * max(replicas) + 256)
    if limit < 2 * max(replicas) + 128:
        p.error(f"the open-file limit ({limit}) is too low for {max(replicas)} replicas")
    DEGRADED.clear()
    runs = [asyncio.run(one_run(opts)) for _ in range(opts.runs)]
    result = summarise(runs, opts)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fleet.json").write_text(json.dumps(result, indent=2))
    text = markdown(result)
    (args.out / "fleet.md").write_text(text + "\n")
    plot(result, args.plot)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
