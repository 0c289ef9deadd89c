"""``python -m bench.fleet --redis-replicas 0,1,2``: the fan-out tier measured, one primary
with 0, 1 and 2 Redis replicas (``--replicaof``, real ``redis-server`` processes on
127.0.0.1), and projected to 10,000 and 30,000 sidecars in one namespace.

The simulated sidecars are bench.fleet's, as a Detour process with ``DETOUR_REDIS_REPLICAS``
holds its connections: the subscription and the poll's connection on its replica (the
sidecars spread round-robin over the replicas; on the primary with none), and a command
connection to the primary for its flushes (``report.lua``, a write). The windows are
opened by a real ``RedisStore`` on the primary. Per phase (idle, polls, flushes, window
pushes, mixed) the CPU of the primary and of each replica (``INFO cpu``), the fan-out and
propagation times of every push, and under the mixed load the replication lag: the
primary's ``master_repl_offset`` minus each replica's offset, sampled every 50 ms (bytes).

Per-unit costs, over each server's idle rate: the primary's CPU per window pushed and per
flush; each replica's CPU per subscription pushed (its CPU over windows x its
subscriptions) and per poll. The projection adds them up for ``SIDECARS`` sidecars sending
1,000 messages/s each (summed into one flush per sidecar per flush interval, as the
sidecars do), at 1, 10 and 100 windows/s; a replica's fan-out of one push is modelled as its
subscriptions x its cost per subscription, Redis's share of the propagation as the
window script on the primary plus that fan-out (the receivers' own delay left out), and
checked against the measured points.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.fleet import Commands, Fleet, Flush, Options, Phase, Replica, _pct, resp
from bench.receiver import Receiver
from service.settings import Settings
from service.store import scripts
from service.store.base import ReportIn
from service.store.redis import RedisStore
from tests.procs import RedisServer, wait_until

#: the projection's fleets, windows per s and flush intervals (s)
SIDECARS = (10_000, 30_000)
WINDOWS_PER_S = (1, 10, 100)
FLUSH_INTERVALS_S = (1.0, 10.0)
#: the targets: propagation p99 and the primary's share of a core
TARGET_P99_MS = 50.0
TARGET_PRIMARY_CORES = 0.5
#: a Detour process on a replica polls the primary's version this often (the default)
PRIMARY_POLL_S = 10.0
PHASES = ("idle", "poll", "flush", "push", "mixed")


def _cpu(client: Any) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


class TierFleet(Fleet):
    """bench.fleet's fleet with its reads on Redis replicas and its flushes on the primary."""

    def __init__(
        self, server: RedisServer, store: RedisStore, opts: Options, readers: list[RedisServer]
    ) -> None:
        super().__init__(server, store, opts)
        self.readers = readers or [server]
        self.reader_infos = [r.client() for r in readers]
        for c in self.reader_infos:
            # (scripts are not replicated: a Detour process loads poll.lua on NOSCRIPT)
            c.script_load(scripts.source("poll"))
        #: each sidecar's connection to the primary for its flushes (its ``cmd`` with none)
        self.flushers: list[Commands] = []
        #: the replicas' CPU at each ``redis_counters`` call of the current phase
        self.marks: list[list[float]] = []
        #: the sidecars' subscriptions (bench/receiver.c), started by ``grow``
        self.receiver: Receiver | None = None

    async def grow(self, n: int) -> None:
        """The sidecars' command connections here; their subscriptions in bench/receiver.c
        (subscription i on reader ``i % readers``, as sidecar i's poll connection)."""
        loop = asyncio.get_running_loop()
        opts, keys = self.opts, self.keys
        if self.receiver is not None:
            await self.receiver.close()
        self.receiver = Receiver(keys.channel, n, [r.port for r in self.readers])
        await self.receiver.start()
        while len(self.replicas) < n:
            for i in range(len(self.replicas), min(n, len(self.replicas) + 200)):
                rid = f"fleet-{i}"
                reader = self.readers[i % len(self.readers)]
                _, cmd = await loop.create_connection(Commands, "127.0.0.1", reader.port)
                flusher = cmd
                if reader is not self.server:
                    _, flusher = await loop.create_connection(
                        Commands, "127.0.0.1", self.server.port
                    )
                # (the lineage pair of a replica that reached none: nothing to check)
                poll = resp("EVALSHA", self.poll_sha, 2, keys.meta, keys.writers, rid, 0, "")
                flush = Flush(
                    self.store, self.report_keys, rid, opts.flush_brokers, opts.flush_buckets
                )
                self.replicas.append(Replica(None, cmd, poll, flush))
                self.flushers.append(flusher)

    async def _deliveries(self, sent: dict[bytes, float], result: Phase) -> None:
        """Wait (bounded) for every subscription to receive every push, as the reader saw
        them; fan-out and propagation times of what arrived."""
        assert self.receiver is not None
        n = len(self.replicas)
        seen: dict[bytes, dict[int, float]] = {b: {} for b in sent}
        deadline = time.perf_counter() + 10
        while True:
            for name, sub, t in await self.receiver.arrivals():
                if name in seen:
                    seen[name].setdefault(sub, t)
            if all(len(v) == n for v in seen.values()) or time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.02)
        got = 0
        for broker, t0 in sent.items():
            times = list(seen[broker].values())
            got += len(times)
            if times:
                result.fanout_ms.append((max(times) - min(times)) * 1000)
                result.propagation_ms += [(t - t0) * 1000 for t in times]
        result.delivered = got / (len(sent) * n)

    async def _spread(self, interval_s: float, pick: str, end: float, start: float) -> int:
        n = len(self.replicas)
        sent = 0
        while (now := time.perf_counter()) < end:
            due = int((now - start) * n / interval_s)
            while sent < due:
                i = sent % n
                r = self.replicas[i]
                if pick == "poll":
                    r.cmd.send(r.poll)
                else:
                    self.flushers[i].send(r.flush.command())
                sent += 1
            await asyncio.sleep(0.005)
        return sent

    def _connections(self) -> list[Commands]:
        seen = {id(c): c for c in [r.cmd for r in self.replicas] + self.flushers}
        return list(seen.values())

    async def drain(self) -> None:
        self.drains += 1
        token = f"drained-{self.drains}".encode()
        await asyncio.wait_for(asyncio.gather(*(c.drain(token) for c in self._connections())), 30)

    def errors(self) -> int:
        return sum(c.errors for c in self._connections())

    def redis_counters(self) -> tuple[float, int]:
        self.marks.append([_cpu(c) for c in self.reader_infos])
        return super().redis_counters()

    def lag(self) -> list[int]:
        """Bytes each replica is behind the primary now."""
        head = int(self.info.info("replication")["master_repl_offset"])
        return [
            max(0, head - int(c.info("replication").get("slave_repl_offset", head)))
            for c in self.reader_infos
        ]

    async def _sample_lag(self, until: float, out: list[int]) -> None:
        while time.perf_counter() < until:
            out += self.lag()
            await asyncio.sleep(0.05)

    async def tier_phase(self, name: str) -> TierPhase:
        self.marks = []
        lag: list[int] = []
        sampler = None
        if name == "mixed" and self.reader_infos:
            until = time.perf_counter() + 0.1 + self.opts.phase_s
            sampler = asyncio.create_task(self._sample_lag(until, lag))
        p = await self.phase(name)
        if sampler is not None:
            await sampler
        replica_cpu = [b - a for a, b in zip(self.marks[0], self.marks[1], strict=True)]
        return TierPhase(
            name,
            p.seconds,
            p.redis_cpu_s,
            replica_cpu,
            p.units,
            p.fanout_ms,
            p.propagation_ms,
            p.delivered,
            lag,
        )

    def close(self) -> None:
        super().close()
        for t in {id(c): c.transport for c in self.flushers}.values():
            if t is not None:
                t.close()
        for c in self.reader_infos:
            c.close()


@dataclass
class TierPhase:
    name: str
    seconds: float
    primary_cpu_s: float
    replica_cpu_s: list[float]
    units: int
    fanout_ms: list[float] = field(default_factory=list)
    propagation_ms: list[float] = field(default_factory=list)
    delivered: float = math.nan
    lag_bytes: list[int] = field(default_factory=list)


def _replica(primary: RedisServer, maxclients: int) -> RedisServer:
    server = RedisServer(
        extra=[
            "--replicaof",
            "127.0.0.1",
            str(primary.port),
            "--maxclients",
            str(maxclients),
        ]
    )
    with server.client() as c:
        wait_until(
            lambda: c.info("replication")["master_link_status"] == "up", 30, "the replica in sync"
        )
    return server


async def tier_run(opts: Options, redis_replicas: int, n: int) -> dict[str, TierPhase]:
    """One primary with ``redis_replicas`` replicas, ``n`` sidecars on them."""
    # (a master's setting: without it, each replica's full sync waits 5 s for more replicas)
    primary = RedisServer(
        extra=["--maxclients", str(3 * n + 64), "--repl-diskless-sync-delay", "0"]
    )
    readers: list[RedisServer] = []
    store = RedisStore(
        Settings(
            redis_url=primary.url,
            sync_interval_s=opts.sync_interval_s,
            redis_timeout_s=10,
            redis_call_timeout_s=10,
            report_flush_ms=0,
        )
    )
    fleet: TierFleet | None = None
    try:
        readers = [_replica(primary, 2 * n + 64) for _ in range(redis_replicas)]
        await store.start()
        await asyncio.wait_for(store.synced.wait(), 30)
        await store.report_many([ReportIn("steady", 10)])
        fleet = TierFleet(primary, store, opts, readers)
        await fleet.grow(n)
        out = {name: await fleet.tier_phase(name) for name in PHASES}
        if store.journal_size:
            raise RuntimeError(f"{store.journal_size} reports went to the journal, not Redis")
        if fleet.errors():
            raise RuntimeError(f"{fleet.errors()} error replies on the command connections")
        return out
    finally:
        if fleet is not None:
            fleet.close()
            if fleet.receiver is not None:
                await fleet.receiver.close()
        await store.close()
        for r in readers:
            r.stop()
        primary.stop()


def tier_costs(phases: dict[str, TierPhase], n: int) -> dict[str, float]:
    """Per-unit CPU µs over each server's idle rate; replica figures summed over replicas."""
    idle = phases["idle"]
    p_idle = idle.primary_cpu_s / idle.seconds
    r_idle = [c / idle.seconds for c in idle.replica_cpu_s]

    def primary(p: TierPhase) -> float:
        return max(0.0, p.primary_cpu_s - p_idle * p.seconds) * 1e6 / max(1, p.units)

    def replicas(p: TierPhase) -> float:
        return (
            sum(max(0.0, c - r * p.seconds) for c, r in zip(p.replica_cpu_s, r_idle, strict=True))
            * 1e6
        )

    push = phases["push"]
    out = {
        "primary_push_us": primary(push),
        "primary_flush_us": primary(phases["flush"]),
        "primary_poll_us": primary(phases["poll"]),
    }
    if idle.replica_cpu_s:
        out["replica_per_sub_us"] = replicas(push) / max(1, push.units * n)
        out["replica_poll_us"] = replicas(phases["poll"]) / max(1, phases["poll"].units)
    return out


def summarise_tier(
    runs: dict[int, list[dict[str, TierPhase]]], n: int, opts: Options
) -> dict[str, Any]:
    """Medians across runs per replica count; the model and its projection."""
    per_r: dict[str, Any] = {}
    for r, rs in sorted(runs.items()):
        costs = [tier_costs(x, n) for x in rs]

        def med(name: str, what: str, rs: list[dict[str, TierPhase]] = rs) -> float:
            vals = []
            for x in rs:
                p = x[name]
                if what == "primary_share":
                    vals.append(p.primary_cpu_s / p.seconds)
                elif what == "replica_share":
                    vals.append(max(p.replica_cpu_s, default=0.0) / p.seconds)
                elif what == "lag_p99":
                    vals.append(_pct(p.lag_bytes, 99) if p.lag_bytes else 0.0)
                elif what == "lag_max":
                    vals.append(float(max(p.lag_bytes, default=0)))
                elif what == "delivered":
                    vals.append(p.delivered)
                else:
                    src = p.fanout_ms if what.startswith("fanout") else p.propagation_ms
                    vals.append(_pct(src, 50 if what.endswith("p50") else 99))
            return statistics.median(vals)

        per_r[str(r)] = {
            "costs": {k: statistics.median(c[k] for c in costs) for k in costs[0]},
            "push": {
                k: med("push", k)
                for k in (
                    "fanout_p50",
                    "fanout_p99",
                    "propagation_p50",
                    "propagation_p99",
                    "delivered",
                )
            },
            "mixed": {
                k: med("mixed", k)
                for k in (
                    "fanout_p50",
                    "fanout_p99",
                    "propagation_p50",
                    "propagation_p99",
                    "primary_share",
                    "replica_share",
                    "lag_p99",
                    "lag_max",
                    "delivered",
                )
            },
        }
    model = tier_model(per_r, n)
    return {
        "subscriptions": n,
        "options": {
            k: getattr(opts, k)
            for k in (
                "runs",
                "phase_s",
                "sync_interval_s",
                "flush_interval_s",
                "flush_brokers",
                "push_rate",
                "mixed_faults",
            )
        },
        "runs": opts.runs,
        "by_redis_replicas": per_r,
        "model": model,
        "projection": project(model),
    }


def tier_model(per_r: dict[str, Any], n: int) -> dict[str, Any]:
    """The per-unit costs the projection uses, from the measured replica counts, and the
    model's propagation p99 at each measured point against the measurement."""
    tiers = [r for r in per_r if r != "0"]
    src = tiers or list(per_r)
    costs = [per_r[r]["costs"] for r in src]
    per_sub = statistics.median(c.get("replica_per_sub_us", math.nan) for c in costs)
    # Redis's share of a window's propagation: the window script on the primary, then one
    # replica's delivery to its subscriptions, one after another on its one thread (the
    # replication hop on loopback is left out, and so is the receivers' own delay, which the
    # measured times include: the check shows how far they are from this)
    primary_us = statistics.median(per_r[r]["costs"]["primary_push_us"] for r in src)
    base = primary_us / 1000
    model = {
        "primary_push_us": primary_us,
        "primary_flush_us": statistics.median(per_r[r]["costs"]["primary_flush_us"] for r in per_r),
        "poll_us": statistics.median(
            per_r[r]["costs"].get("replica_poll_us", per_r[r]["costs"]["primary_poll_us"])
            for r in src
        ),
        "replica_per_sub_us": per_sub,
        "base_p99_ms": base,
        "check": {
            r: {
                "measured_p99_ms": per_r[r]["push"]["propagation_p99"],
                "model_p99_ms": base + n / int(r) * per_sub / 1000,
            }
            for r in tiers
        },
    }
    return model


def project(model: dict[str, Any]) -> list[dict[str, Any]]:
    """For each fleet, windows rate and flush interval: the fewest replicas that keep the
    modelled propagation p99 within the target, and the primary's and a replica's cores."""
    rows = []
    for sidecars in SIDECARS:
        for windows in WINDOWS_PER_S:
            for flush_s in FLUSH_INTERVALS_S:
                primary = (
                    sidecars / flush_s * model["primary_flush_us"]
                    + sidecars / PRIMARY_POLL_S * model["poll_us"]
                    + windows * model["primary_push_us"]
                ) / 1e6
                need = math.nan
                replica_cores = math.nan
                for r in range(1, 1001):
                    subs = sidecars / r
                    p99 = model["base_p99_ms"] + subs * model["replica_per_sub_us"] / 1000
                    cores = (
                        subs * model["poll_us"] + windows * subs * model["replica_per_sub_us"]
                    ) / 1e6
                    if p99 <= TARGET_P99_MS and cores <= 0.8:
                        need, replica_cores = r, cores
                        break
                rows.append(
                    {
                        "sidecars": sidecars,
                        "windows_per_s": windows,
                        "flush_interval_s": flush_s,
                        "replicas_needed": need,
                        "primary_cores": primary,
                        "primary_within_target": primary <= TARGET_PRIMARY_CORES,
                        "replica_cores": replica_cores,
                    }
                )
    return rows


def markdown_tier(result: dict[str, Any]) -> str:
    n = result["subscriptions"]
    lines = [
        f"Fan-out tier: {n} subscriptions, medians of {result['runs']} runs",
        "",
        "| Redis replicas | primary µs / window | primary µs / flush | replica µs / "
        "subscription pushed | fan-out p50 / p99 ms | propagation p50 / p99 ms | delivered | "
        "mixed: primary CPU | mixed: busiest replica CPU | mixed: propagation p99 ms | "
        "mixed: lag p99 / max bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, row in result["by_redis_replicas"].items():
        c, p, m = row["costs"], row["push"], row["mixed"]
        lines.append(
            f"| {r} | {c['primary_push_us']:.0f} | {c['primary_flush_us']:.0f} | "
            f"{c.get('replica_per_sub_us', math.nan):.2f} | "
            f"{p['fanout_p50']:.1f} / {p['fanout_p99']:.1f} | "
            f"{p['propagation_p50']:.1f} / {p['propagation_p99']:.1f} | "
            f"{p['delivered']:.3f} | {m['primary_share']:.2f} | {m['replica_share']:.2f} | "
            f"{m['propagation_p99']:.1f} | {m['lag_p99']:.0f} / {m['lag_max']:.0f} |"
        )
    model = result["model"]
    lines += [
        "",
        f"Model: primary {model['primary_push_us']:.0f} µs per window and "
        f"{model['primary_flush_us']:.0f} µs per flush; a replica "
        f"{model['replica_per_sub_us']:.2f} µs per subscription pushed and "
        f"{model['poll_us']:.0f} µs per poll; Redis's share of the "
        f"propagation = {model['base_p99_ms']:.1f} ms (the window script) + subscriptions "
        "per replica × per-subscription cost.",
        "",
        "| Redis replicas | measured propagation p99 ms | model: Redis's share ms |",
        "|---|---|---|",
    ]
    for r, chk in model["check"].items():
        lines.append(f"| {r} | {chk['measured_p99_ms']:.1f} | {chk['model_p99_ms']:.1f} |")
    lines += [
        "",
        "| sidecars | windows/s | flush every s | replicas for p99 ≤ 50 ms | "
        "primary cores | primary ≤ 0.5 | a replica's cores |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["projection"]:
        lines.append(
            f"| {row['sidecars']:,} | {row['windows_per_s']} | {row['flush_interval_s']:g} | "
            f"{row['replicas_needed']} | {row['primary_cores']:.2f} | "
            f"{'yes' if row['primary_within_target'] else 'no'} | {row['replica_cores']:.2f} |"
        )
    return "\n".join(lines)


def plot_tier(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = result["model"]
    fig, ax = plt.subplots(figsize=(7, 4))
    rs = list(range(1, 41))
    for sidecars in SIDECARS:
        ax.plot(
            rs,
            [model["base_p99_ms"] + sidecars / r * model["replica_per_sub_us"] / 1000 for r in rs],
            label=f"{sidecars:,} sidecars: Redis's share (model)",
        )
    for r, chk in model["check"].items():
        ax.scatter([int(r)], [chk["measured_p99_ms"]], color="black", zorder=3)
        ax.annotate(
            f"measured p99, {result['subscriptions']:,} subs (receiver included)",
            (int(r), chk["measured_p99_ms"]),
            fontsize=7,
        )
    ax.axhline(TARGET_P99_MS, color="red", linestyle="--", label="50 ms")
    ax.set_xlabel("Redis replicas")
    ax.set_ylabel("propagation (ms)")
    ax.set_yscale("log")
    ax.set_title("Fan-out tier: a window's propagation by Redis replicas")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main_tier(opts: Options, redis_replicas: list[int], n: int, out: Path, plot: Path) -> int:
    runs = {
        r: [asyncio.run(tier_run(opts, r, n)) for _ in range(opts.runs)] for r in redis_replicas
    }
    result = summarise_tier(runs, n, opts)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet-tier.json").write_text(json.dumps(result, indent=2))
    text = markdown_tier(result)
    (out / "fleet-tier.md").write_text(text + "\n")
    plot_tier(result, plot)
    print(text)
    return 0
