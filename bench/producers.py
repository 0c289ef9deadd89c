"""Overload as producers see it: SDK producers against a CPU-capped Detour at 5x its capacity.

``python -m bench.producers [--cap QUOTA_US/PERIOD_US ...] [--modes remote,cached] [--runs N]``

What matters under overload is not how fast Detour refuses but whether it ever makes a
send wait or fail. For each CPU cap (``bench/cgroup.py``; a short period, and the
Kubernetes default of 100 ms, where a throttled process stalls for tens of ms) and each
SDK mode, one run:

1. a fresh Detour (one worker, the service's defaults) on a real redis-server, capped;
   its **capacity**: the selects per second it answers (not refusals) under wrk's closed
   loop at 16 connections, measured in the run;
2. **over**: producer processes using the SDK as shipped (``DetourClient`` with its
   defaults: the 0.2 s timeout, the circuit breaker, fail-open, the 4 ms decision
   deadline) offer ``--factor`` (5) times that capacity in sends per second, each send a
   select, a no-op delivery and a report; ``--over`` seconds;
3. **after**: the same producers at a fifth of the capacity for ``--after`` seconds.

The delivery is a no-op, not a stand-in broker: the generator's CPU is what limits how
much it can offer on a 2-core machine that also runs Detour and Redis, and a broker
would spend it without changing what Detour does to the producer.

Measured in the producers: the time to decide (``select``) per phase, p50/p99/max; the
share decided by Detour or locally; sends that failed because of Detour; the time a
report took; the SDK's counters (late answers, reports sent, pending, dropped). Cached
mode also: how stale its copy of the table got, and how soon after the overload every
copy was current again. A canary route is changed every 250 ms (an admin ``PUT``
through the same capped Detour, retried until it is accepted) and every producer watches
for each change with a local select (``route: canary`` returns its broker). Measured in
Detour: its answers by status (any 5xx but 503 SYSTEM_BUSY is a failure), its refusals,
and its resident memory.

Results: ``bench/out/producers.json`` and a Markdown table on stdout (docs/BENCHMARKS.md,
"Overload as producers see it").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.cgroup import CpuCap
from bench.loadgen import run_wrk, wait_for_quiet, write_script
from detour.client import DetourClient, wire
from detour.client.errors import DetourUnavailable
from detour.client.local import LocalTable
from tests.procs import RedisServer, ServiceProcess

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
TOPIC = "orders"
CANARY = "canary"
ROUTE = {"brokers": [{"brokerName": f"broker-{c}", "writeQueueNums": 4} for c in "abcd"]}
#: Targets from the issue: remote decide p99, cached decide p99, every copy current again.
TARGET_REMOTE_P99_MS = 5.0
TARGET_CACHED_P99_US = 50.0
TARGET_CURRENT_S = 2.0


def canary_route(generation: int) -> dict[str, Any]:
    return {"brokers": [{"brokerName": f"gen-{generation}", "writeQueueNums": 1}]}


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "p50": ordered[len(ordered) // 2],
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max": ordered[-1],
    }


# -- the producer process ------------------------------------------------------------


#: Thread name fragments -> what the thread does, for ``TimedLock``'s records.
_ROLES = (("send_loop", "send"), ("watch_canary", "canary"), ("detour-stream", "stream"),
          ("detour-flush", "flush"))


def _role() -> str:
    name = threading.current_thread().name
    return next((role for part, role in _ROLES if part in name), name)


class TimedLock:
    """The client's table lock, timed (``--time-locks``): how long each thread waited for
    it, and how long each caller held it. A decision that waits, waits here or for the
    interpreter; this says which."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._since = 0
        self.waits: dict[str, list[float]] = {}
        self.holds: dict[str, list[float]] = {}

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        t0 = time.perf_counter_ns()
        ok: bool = self._inner.acquire(blocking, timeout)
        self._since = t1 = time.perf_counter_ns()
        self.waits.setdefault(_role(), []).append((t1 - t0) / 1000)
        return ok

    def release(self) -> None:
        held = (time.perf_counter_ns() - self._since) / 1000
        caller = sys._getframe(2).f_code.co_name  # the table method that took it
        self.holds.setdefault(f"{_role()} {caller}", []).append(held)
        self._inner.release()

    def __enter__(self) -> TimedLock:
        self.acquire()
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def _phases(cfg: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """(name, start, end, sends a second in all) of the two phases."""
    over_end = cfg["start"] + cfg["over_s"]
    return [("over", cfg["start"], over_end, cfg["rate_over"]),
            ("after", over_end, over_end + cfg["after_s"], cfg["rate_after"])]


def floor_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """A floor, in a process of its own with one thread: a call paced as one producer's
    sends are (``cfg["floor"]``: ``select``, the bare in-process select on a table with the
    same route and nothing else, no SDK, stream or reports; ``empty``, a call of a function
    that does nothing). A thread that slept runs its first microseconds slowly (cold
    caches, an idle vCPU waking), so their p99s are what a decision after a sleep costs on
    this machine: this select's, and any decision's at the least.

    Not a thread of the producers' processes: there, each floor thread woke as often as the
    sending thread and then waited for the interpreter it held, so the floors took the
    sender's core from it in the middle of its decisions (beside a CPU hog, its p99 was
    80-177 µs with them and 7-37 µs without: docs/BENCHMARKS.md, "The floors moved out")."""
    bare = LocalTable(lambda: int(time.time() * 1000), producer="floor")
    bare.set_route(TOPIC, wire.route({"topic": TOPIC, **ROUTE}))

    def nothing() -> None:
        return None

    fn: Callable[[], object] = nothing
    if cfg["floor"] == "select":
        fn = lambda: bare.select(TOPIC, None)  # noqa: E731 - the call timed
    out: dict[str, list[float]] = {}
    for name, start, end, rate in _phases(cfg):
        period = cfg["threads"] / rate if rate > 0 else end - start
        due = start + 0.5 * period / cfg["threads"]  # between two sends
        mine = out[name] = []
        while due < end:
            now = time.time()
            if now < due:
                time.sleep(due - now)
            t0 = time.perf_counter_ns()
            fn()
            mine.append((time.perf_counter_ns() - t0) / 1000)
            due += period
    return {"floor": cfg["floor"], "us": {k: percentiles(v) for k, v in out.items()}}


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """One producer process: ``threads`` threads sending on one SDK client, paced to
    ``rate_over`` then ``rate_after`` sends a second in all."""
    if cfg.get("floor"):
        return floor_worker(cfg)
    client = DetourClient(cfg["url"], mode=cfg["mode"], producer=f"bench-{os.getpid()}")
    # Collections of the cyclic GC, timed: a decision that lands on one waits for it.
    gc_pauses: list[tuple[int, float]] = []
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_pauses.append((info["generation"], (time.perf_counter() - gc_started[0]) * 1e6))

    gc.callbacks.append(on_gc)
    cached = cfg["mode"] == "cached"
    timed = None
    if cfg.get("time_locks"):
        table = client._core.table
        timed = table._lock = TimedLock(table._lock)  # type: ignore[assignment]
    deadline = time.monotonic() + 30
    if cached:
        client.wait_ready(30)
    else:
        # Producers start with Detour answering: each knows the route and the config before
        # the overload (a producer that starts during one and never got them cannot decide
        # at all; the SDK has no public "knows" yet, hence the core's).
        # Detour may still be working off the capacity measurement's backlog: a select
        # that finds it unavailable before the route is known is tried again.
        while not client._core.knows(TOPIC) and time.monotonic() < deadline:
            with contextlib.suppress(DetourUnavailable):
                client.select(TOPIC)
            time.sleep(0.05)
    phases = _phases(cfg)
    lock = threading.Lock()
    decide: dict[str, list[float]] = {p[0]: [] for p in phases}
    report: dict[str, list[float]] = {p[0]: [] for p in phases}
    local: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    lag: list[float] = []

    def send_loop(offset: float) -> None:
        for name, start, end, rate in phases:
            period = cfg["threads"] / rate if rate > 0 else end - start
            due = start + offset * period
            mine_decide, mine_report = [], []
            while due < end:
                now = time.time()
                if now < due:
                    time.sleep(due - now)
                else:
                    lag.append(now - due)
                t0 = time.perf_counter_ns()
                try:
                    queue = client.select(TOPIC)
                except Exception as exc:  # noqa: BLE001 - a send Detour failed: counted
                    with lock:
                        failed[f"select {type(exc).__name__}"] += 1
                    due += period
                    continue
                t1 = time.perf_counter_ns()
                try:
                    client.report(queue.broker_name, 1.0)
                except Exception as exc:  # noqa: BLE001 - counted
                    with lock:
                        failed[f"report {type(exc).__name__}"] += 1
                t2 = time.perf_counter_ns()
                mine_decide.append((t1 - t0) / 1000)
                mine_report.append((t2 - t1) / 1000)
                if queue.local:
                    with lock:
                        local[name] += 1
                due += period
            with lock:
                decide[name] += mine_decide
                report[name] += mine_report

    seen: dict[int, float] = {}
    stop = threading.Event()

    def watch_canary() -> None:
        while not stop.is_set():
            try:
                broker = client.select(CANARY).broker_name
                generation = int(broker.split("-")[1])
                seen.setdefault(generation, time.time())
            except Exception:  # noqa: BLE001 - no route yet: the next look tells
                pass
            stop.wait(0.02)

    threads = [threading.Thread(target=send_loop, args=(i / cfg["threads"],))
               for i in range(cfg["threads"])]
    watcher = threading.Thread(target=watch_canary)
    if cached:
        watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    if cached:
        watcher.join()
    client.close(flush_timeout=10)
    stats = client.stats()
    return {
        "decide_us": {k: percentiles(v) for k, v in decide.items()},
        "gc_us": {
            str(g): percentiles([us for gen, us in gc_pauses if gen == g]) for g in (0, 1, 2)
        },
        "lock_waits_us": {k: percentiles(v) for k, v in timed.waits.items()} if timed else None,
        "lock_holds_us": {k: percentiles(v) for k, v in timed.holds.items()} if timed else None,
        "report_us": {k: percentiles(v) for k, v in report.items()},
        "sends": {k: len(v) for k, v in decide.items()},
        "local": dict(local),
        "failed": dict(failed),
        "behind_s": percentiles(lag),
        "seen": seen,
        "stats": {
            "remote_selects": stats.remote_selects,
            "local_selects": stats.local_selects,
            "late_answers": stats.late_answers,
            "detour_failures": stats.detour_failures,
            "sent_reports": stats.sent_reports,
            "pending_reports": stats.pending_reports,
            "dropped_reports": stats.dropped_reports,
            "stream_snapshots": stats.stream_snapshots,
        },
    }


# -- the run ---------------------------------------------------------------------------


def capacity(url: str, seconds: int, work: Path) -> float:
    """Selects per second the capped Detour answers (refusals not counted)."""
    script = write_script(work / "select.lua", "/select", [{"topic": TOPIC}])
    r = run_wrk(url, script, connections=16, duration_s=seconds)
    return (r.requests - r.errors.get("status", 0)) / r.duration_s


def detour_counts(url: str) -> dict[str, Any]:
    """Detour's answers by status, and its refusals by reason, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    statuses: Counter[str] = Counter()
    shed: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "detour_http_request_duration_seconds_count":
                statuses[s.labels["status"]] += int(s.value)
            elif s.name == "detour_requests_shed_total":
                shed[s.labels["reason"]] = s.value
    return {"statuses": dict(statuses), "shed": shed}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def run_one(cap: tuple[int, int], mode: str, args: argparse.Namespace,
            work: Path) -> dict[str, Any]:
    redis = RedisServer()
    try:
        with contextlib.ExitStack() as stack:
            svc = stack.enter_context(ServiceProcess(redis_url=redis.url))
            cpu = stack.enter_context(CpuCap(*cap))
            cpu.add(svc.proc.pid)
            with httpx.Client(base_url=svc.url, timeout=10) as admin:
                admin.put(f"/routes/{TOPIC}", json=ROUTE).raise_for_status()
                admin.put(f"/routes/{CANARY}", json=canary_route(0)).raise_for_status()
            quiet = wait_for_quiet(30)
            cap_rps = capacity(svc.url, args.capacity_s, work)
            time.sleep(2)  # the hold of any shedding wrk's closed loop started
            offered = args.factor * cap_rps
            start = time.time() + 4.0  # the producers set up before
            cfg = {"url": svc.url, "mode": mode, "threads": args.threads, "start": start,
                   "over_s": args.over, "after_s": args.after,
                   "rate_over": offered / args.procs, "rate_after": cap_rps / 5 / args.procs,
                   "time_locks": args.time_locks}
            # Cached mode: the floors too, each in a process of its own (``floor_worker``).
            cfgs = [cfg] * args.procs + (
                [{**cfg, "floor": f} for f in ("select", "empty")] if mode == "cached" else [])
            procs = [subprocess.Popen(
                [sys.executable, "-m", "bench.producers", "--worker", json.dumps(c)],
                cwd=ROOT, stdout=subprocess.PIPE, text=True) for c in cfgs]
            acked: dict[int, float] = {}
            rss: list[int] = []
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    rss.append(rss_kib(svc.proc.pid))
                    done.wait(0.25)

            def canary() -> None:
                generation = 0
                with httpx.Client(base_url=svc.url, timeout=2) as admin:
                    while not done.is_set():
                        generation += 1
                        while not done.is_set():
                            with contextlib.suppress(httpx.HTTPError):
                                r = admin.put(f"/routes/{CANARY}", json=canary_route(generation))
                                if r.status_code == 200:
                                    acked[generation] = time.time()
                                    break
                            done.wait(0.05)
                        done.wait(0.25)

            helpers = [threading.Thread(target=sample)]
            if mode == "cached":
                helpers.append(threading.Thread(target=canary))
            for t in helpers:
                t.start()
            before = cpu.throttled()
            results = []
            try:
                for p in procs:
                    out, _ = p.communicate(timeout=args.over + args.after + 120)
                    if p.returncode != 0 or not out.strip():
                        raise RuntimeError(f"a producer process failed ({p.returncode})")
                    results.append(json.loads(out.splitlines()[-1]))
            finally:
                done.set()
                for t in helpers:
                    t.join()
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            after_throttled = cpu.throttled()
            counts = detour_counts(svc.url)
            floors = {r["floor"]: r["us"] for r in results if "floor" in r}
            results = [r for r in results if "floor" not in r]
            return summarize(mode, cap, cap_rps, offered, start, args, results, acked, rss,
                             counts, before, after_throttled, quiet, floors)
    finally:
        redis.stop()


def summarize(mode: str, cap: tuple[int, int], cap_rps: float, offered: float, start: float,
              args: argparse.Namespace, results: list[dict[str, Any]],
              acked: dict[int, float], rss: list[int], counts: dict[str, Any],
              before: dict[str, int], after: dict[str, int],
              quiet: tuple[float, float],
              floors: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def worst(key: str, phase: str, stat: str) -> float | None:
        vals = [r[key][phase][stat] for r in results if r[key][phase][stat] is not None]
        return max(vals) if vals else None

    def median(key: str, phase: str, stat: str) -> float | None:
        vals = [r[key][phase][stat] for r in results if r[key][phase][stat] is not None]
        return statistics.median(vals) if vals else None

    phases: dict[str, Any] = {}
    for phase, seconds in (("over", args.over), ("after", args.after)):
        sends = sum(r["sends"][phase] for r in results)
        local = sum(r["local"].get(phase, 0) for r in results)
        phases[phase] = {
            "sends_per_s": sends / seconds,
            "local_share": local / sends if sends else None,
            # Per-process percentiles: the median process's p50, the worst p99 and max.
            "decide_p50_us": median("decide_us", phase, "p50"),
            "decide_p99_us": worst("decide_us", phase, "p99"),
            "decide_max_us": worst("decide_us", phase, "max"),
            "report_p99_us": worst("report_us", phase, "p99"),
            "report_max_us": worst("report_us", phase, "max"),
            "floor_p50_us": floors.get("select", {}).get(phase, {}).get("p50"),
            "floor_p99_us": floors.get("select", {}).get(phase, {}).get("p99"),
            "empty_p50_us": floors.get("empty", {}).get(phase, {}).get("p50"),
            "empty_p99_us": floors.get("empty", {}).get(phase, {}).get("p99"),
        }
    failed: Counter[str] = Counter()
    stats: Counter[str] = Counter()
    for r in results:
        failed.update(r["failed"])
        stats.update(r["stats"])
    staleness: list[float] = []
    end = start + args.over
    current_again: float | None = None
    if mode == "cached" and acked:
        for r in results:
            for generation, when in r["seen"].items():
                at = acked.get(int(generation))
                if at is not None and at < end:
                    staleness.append(when - at)
        firsts = [g for g, at in sorted(acked.items()) if at >= end]
        if firsts:
            g = firsts[0]
            seen_at = [r["seen"].get(str(g)) for r in results]
            if all(s is not None for s in seen_at):
                current_again = max(float(s) for s in seen_at if s is not None) - end
    statuses = counts["statuses"]
    bad_5xx = sum(n for status, n in statuses.items() if status.startswith("5") and status != "503")
    return {
        "mode": mode,
        "cap": {"quota_us": cap[0], "period_us": cap[1], "cores": cap[0] / cap[1]},
        "capacity_rps": cap_rps,
        "offered_sends_per_s": offered,
        "phases": phases,
        "failed_sends": dict(failed),
        "producers_gc_us": [r["gc_us"] for r in results],
        "producers_lock_waits_us": [r["lock_waits_us"] for r in results],
        "producers_lock_holds_us": [r["lock_holds_us"] for r in results],
        "sdk": dict(stats),
        "staleness_s": percentiles(staleness),
        "current_again_s": current_again,
        "detour": {"statuses": statuses, "bad_5xx": bad_5xx, "shed": counts["shed"],
                   "rss_max_mib": max(rss) / 1024 if rss else None,
                   "rss_first_mib": rss[0] / 1024 if rss else None,
                   "throttled_periods": after.get("nr_throttled", 0) - before.get(
                       "nr_throttled", 0),
                   "periods": after.get("nr_periods", 0) - before.get("nr_periods", 0)},
        "machine_busy_cores_before": quiet[1],
    }


# -- reporting ------------------------------------------------------------------------


def _ms(us: float | None) -> str:
    return "—" if us is None else f"{us / 1000:.2f}"


def _us(us: float | None) -> str:
    return "—" if us is None else f"{us:.0f}"


def markdown(results: Sequence[dict[str, Any]], command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        "| cap | mode | capacity sel/s | offered sends/s (x) | phase | sends/s | decided "
        "locally | decide p50 / p99 / max | report p99 / max ms | failed sends | late answers "
        "| reports sent / pending / dropped | staleness p50 / max s | current again s | Detour "
        "5xx not 503 | refused 503 | RSS max MiB | stream snapshots |",
        "|---|---|---:|---:|---|---:|---:|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        cap = r["cap"]
        for phase in ("over", "after"):
            p = r["phases"][phase]
            unit = (f"{_us(p['decide_p50_us'])} / {_us(p['decide_p99_us'])} / "
                    f"{_us(p['decide_max_us'])} µs") if r["mode"] == "cached" else (
                f"{_ms(p['decide_p50_us'])} / {_ms(p['decide_p99_us'])} / "
                f"{_ms(p['decide_max_us'])} ms")
            stale = r["staleness_s"]
            stale_text = "—" if stale["n"] == 0 else f"{stale['p50']:.2f} / {stale['max']:.2f}"
            share = "—" if p["local_share"] is None else f"{p['local_share'] * 100:.0f}%"
            again = r["current_again_s"]
            again_text = "—" if again is None else f"{again:.2f}"
            sdk = r["sdk"]
            detour = r["detour"]
            refused = sum(detour["shed"].values()) + detour["statuses"].get("503", 0)
            lines.append(
                f"| {cap['cores']:.2f} cores, {cap['period_us'] / 1000:g} ms period | {r['mode']}"
                f" | {r['capacity_rps']:,.0f} | {r['offered_sends_per_s']:,.0f} "
                f"({r['offered_sends_per_s'] / r['capacity_rps']:.1f}x) | {phase} | "
                f"{p['sends_per_s']:,.0f} | {share} | {unit} | "
                f"{_ms(p['report_p99_us'])} / {_ms(p['report_max_us'])} | "
                f"{sum(r['failed_sends'].values())} | {sdk.get('late_answers', 0)} | "
                f"{sdk.get('sent_reports', 0)} / {sdk.get('pending_reports', 0)} / "
                f"{sdk.get('dropped_reports', 0)} | {stale_text} | {again_text} | "
                f"{detour['bad_5xx']} | {refused:,.0f} | "
                f"{detour['rss_max_mib']:.0f} | {sdk.get('stream_snapshots', 0)} |"
            )
    lines += ["", summary(results)]
    return "\n".join(lines)


def _med(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summary(results: Sequence[dict[str, Any]]) -> str:
    """One row per cap, mode and phase: medians over the runs (failures, 5xx and drops:
    the worst run; memory: the largest)."""
    lines = [
        "| cap | mode | runs | phase | decide p50 / p99 / max (medians) | bare select p50 / "
        "p99 µs, same pacing | empty call p50 / p99 µs, same pacing | decided locally | "
        "failed sends (worst) | reports dropped (worst) "
        "| staleness max s | current again s | Detour 5xx not 503 (worst) | RSS max MiB |",
        "|---|---|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[tuple[float, int, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["cap"]["cores"], r["cap"]["period_us"], r["mode"]), []).append(r)
    for (cores, period, mode), runs in groups.items():
        for phase in ("over", "after"):
            ph = [r["phases"][phase] for r in runs]
            scale, unit = (1.0, "µs") if mode == "cached" else (1000.0, "ms")
            cells = []
            for key in ("decide_p50_us", "decide_p99_us", "decide_max_us"):
                v = _med([x[key] for x in ph])
                cells.append("—" if v is None else f"{v / scale:.2f}")
            fl = [_med([x.get(k) for x in ph]) for k in ("floor_p50_us", "floor_p99_us")]
            floor = "—" if None in fl else f"{fl[0]:.0f} / {fl[1]:.0f}"
            em = [_med([x.get(k) for x in ph]) for k in ("empty_p50_us", "empty_p99_us")]
            floor += " | " + ("—" if None in em else f"{em[0]:.0f} / {em[1]:.0f}")
            share = _med([x["local_share"] for x in ph])
            stale = _med([r["staleness_s"]["max"] for r in runs])
            again = _med([r["current_again_s"] for r in runs])
            rss = max((r["detour"]["rss_max_mib"] or 0) for r in runs)
            lines.append(
                f"| {cores:.2f} cores, {period / 1000:g} ms period | {mode} | {len(runs)} | "
                f"{phase} | {' / '.join(cells)} {unit} | {floor} | "
                f"{'—' if share is None else f'{share * 100:.0f}%'} | "
                f"{max(sum(r['failed_sends'].values()) for r in runs)} | "
                f"{max(r['sdk'].get('dropped_reports', 0) for r in runs)} | "
                f"{'—' if stale is None else f'{stale:.2f}'} | "
                f"{'—' if again is None else f'{again:.2f}'} | "
                f"{max(r['detour']['bad_5xx'] for r in runs)} | {rss:.0f} |"
            )
    return "\n".join(lines)


def parse_cap(text: str) -> tuple[int, int]:
    quota, _, period = text.partition("/")
    return int(quota), int(period)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.producers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--cap", action="append", type=parse_cap,
                   help="CPU cap QUOTA_US/PERIOD_US (repeatable; default 1000/10000 and "
                   "10000/100000: 0.1 cores at a 10 ms and a 100 ms period)")
    p.add_argument("--modes", default="remote,cached")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--factor", type=float, default=5.0)
    p.add_argument("--procs", type=int, default=4, help="producer processes")
    p.add_argument("--threads", type=int, default=1, help="sending threads per process")
    p.add_argument("--over", type=int, default=15, help="seconds at the factor")
    p.add_argument("--after", type=int, default=10, help="seconds at a fifth of capacity")
    p.add_argument("--capacity-s", type=int, default=5)
    p.add_argument("--time-locks", action="store_true",
                   help="time the waits for and holds of each client's table lock "
                        "(bench/out/producers.json: producers_lock_waits_us, _holds_us)")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    caps = args.cap or [(1000, 10_000), (10_000, 100_000)]
    command = "python -m bench.producers " + " ".join(sys.argv[1:] if argv is None else argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for cap in caps:
            for mode in args.modes.split(","):
                for _ in range(args.runs):
                    results.append(run_one(cap, mode, args, Path(tmp)))
                    print(json.dumps(results[-1]), file=sys.stderr)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "producers.json").write_text(json.dumps(results, indent=1))
    print(markdown(results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
