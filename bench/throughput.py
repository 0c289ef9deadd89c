"""Throughput and latency of Detour's /select and /report-latency, next to the floor's.

The number that matters is the ratio to the floor (``bench/floor.py``: the same
FastAPI + uvicorn stack answering a constant body), measured in the same
invocation with floor and Detour runs interleaved, so the machine's drift and
noise (other tenants, frequency scaling, the 2 cores that wrk, Redis and the
servers share) hit both sides alike. Absolute req/s on a shared 2-core box mean
little; the ratio and the CPU spent per request carry over.

For each worker count the servers start once (a fresh redis-server, Detour on
it, the floor); for each connection count every (server, endpoint) pair runs R
times, alternating which side goes first. With 2 workers, uvicorn's workers
share one listening socket and whichever wakes first accepts: with only 8
keep-alive connections one worker can end up holding all of them, so 64
connections are measured too, where the spread is even in practice.

Also here: ``profile_select``, py-spy on a Detour worker while wrk loads /select.
"""

from __future__ import annotations

import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.floor import FloorServer
from bench.loadgen import (
    WrkResult,
    proc_cpu_s,
    process_tree,
    run_wrk,
    system_cpu_s,
    wait_for_quiet,
    write_script,
)
from tests.procs import HttpProcess, RedisServer, ServiceProcess, wait_until

TOPIC = "orders"
BROKERS = ("broker-a", "broker-b")
QUEUES_PER_BROKER = 4
SELECT_BODY: dict[str, Any] = {"topic": TOPIC, "lastBrokerName": None}

#: Endpoint label -> (path, the floor endpoint it is compared with).
ENDPOINTS: dict[str, tuple[str, str]] = {
    "select": ("/select", "select"),
    "report": ("/report-latency", "report"),
    "report-mix": ("/report-latency", "report"),
}


def steady_reports() -> list[dict[str, Any]]:
    """Alternate brokers, every latency below 550 ms: no window opens or moves, no push."""
    latencies = (3, 12, 27, 48, 75, 140, 260, 410, 530)
    return [
        {"brokerName": BROKERS[i % 2], "latencyMs": lat, "isolation": False}
        for i, lat in enumerate(latencies * 2)
    ]


def mixed_reports(n: int = 1000, seed: int = 7) -> list[dict[str, Any]]:
    """A day in production, compressed: mostly fast sends, some slow ones, a few failures.

    90% 1..49 ms, 7% 50..549 ms (no window), 2% 550..2999 ms (30..120 s windows),
    1% failures (isolation: a 600 s window). Windows that open or move are
    written, versioned and pushed to every replica worker; after the first
    failure on a broker most later reports fall inside its window and change nothing.
    """
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for i in range(n):
        u = rng.random()
        isolation = False
        if u < 0.90:
            lat = rng.randint(1, 49)
        elif u < 0.97:
            lat = rng.randint(50, 549)
        elif u < 0.99:
            lat = rng.randint(550, 2999)
        else:
            lat, isolation = rng.randint(1000, 3000), True
        out.append({"brokerName": BROKERS[i % 2], "latencyMs": lat, "isolation": isolation})
    return out


def bodies_for(endpoint: str) -> list[dict[str, Any]]:
    if endpoint == "select":
        return [SELECT_BODY]
    if endpoint == "report":
        return steady_reports()
    return mixed_reports()


# -- the Detour side's state ---------------------------------------------------
def prepare_detour(url: str) -> None:
    """Register the benchmark route and make a few fast reports, so fault items exist."""
    with httpx.Client(base_url=url, timeout=5) as c:
        brokers = [{"brokerName": b, "writeQueueNums": QUEUES_PER_BROKER} for b in BROKERS]
        c.put(f"/routes/{TOPIC}", json={"brokers": brokers}).raise_for_status()
        reset_faults(c)


def reset_faults(c: httpx.Client) -> None:
    """Drop every fault item (the mix opens windows) and make the baseline fast reports."""
    for b in BROKERS:
        r = c.delete(f"/fault-items/{b}")
        if r.status_code not in (204, 404):
            r.raise_for_status()
    for i, b in enumerate(BROKERS * 2):
        body = {"brokerName": b, "latencyMs": 20 + i, "isolation": False}
        c.post("/report-latency", json=body).raise_for_status()


def check_answer(url: str, endpoint: str, floor: bool) -> None:
    """Before a run: the server answers 200 with the expected shape.

    For Detour's /select, both brokers must be available so the select takes the
    plain path, as the floor pretends to. With 2 workers the worker asked may
    not have applied the reset pushed by the other yet, hence a bounded wait.
    """
    path = ENDPOINTS[endpoint][0]
    body = bodies_for(endpoint)[0]

    def plain() -> bool:
        r = httpx.post(url + path, json=body, timeout=5)
        r.raise_for_status()
        answer = r.json()
        return (
            floor
            or endpoint != "select"
            or (answer["decision"] == "available" and not answer["avoidedBrokers"])
        )

    wait_until(plain, 5, f"a plain answer from {url}{path}")


# -- runs ---------------------------------------------------------------------
@dataclass
class Servers:
    workers: int
    redis: RedisServer
    detour: ServiceProcess
    floor: FloorServer
    #: The raw-ASGI floor (no framework): the hot-path targets are ratios to it.
    raw: FloorServer
    #: Detour with the direct lane off (every request through ASGI), on its own namespace.
    asgi: ServiceProcess

    def _server(self, side: str) -> HttpProcess:
        return {"detour": self.detour, "floor": self.floor, "raw": self.raw,
                "asgi": self.asgi}[side]  # fmt: skip

    def url(self, side: str) -> str:
        return self._server(side).url

    def pids(self, side: str) -> list[int]:
        return process_tree(self._server(side).proc.pid)


@contextmanager
def started(workers: int, log_dir: Path | None) -> Iterator[Servers]:
    """Redis, Detour on it and the floor; every process stopped on the way out."""
    with ExitStack() as stack:

        def log(name: str) -> Path | None:
            return log_dir / f"{name}-w{workers}.log" if log_dir else None

        redis = RedisServer()
        stack.callback(redis.stop)
        detour = ServiceProcess(redis_url=redis.url, workers=workers, log_path=log("detour"))
        stack.callback(detour.stop)
        floor = FloorServer(workers=workers, log_path=log("floor"))
        stack.callback(floor.stop)
        raw = FloorServer(workers=workers, log_path=log("raw"), raw=True)
        stack.callback(raw.stop)
        asgi = ServiceProcess(redis_url=redis.url, workers=workers, log_path=log("asgi"),
                              env={"DETOUR_DIRECT_LANE": "false",
                                   "DETOUR_NAMESPACE": "asgi-path"})  # fmt: skip
        stack.callback(asgi.stop)
        prepare_detour(detour.url)
        prepare_detour(asgi.url)
        yield Servers(workers, redis, detour, floor, raw, asgi)


def measure(
    servers: Servers,
    side: str,
    endpoint: str,
    script: Path,
    *,
    connections: int,
    duration_s: int,
    threads: int,
    quiet_wait_s: float = 0.0,
) -> tuple[WrkResult, dict[str, float]]:
    """One wrk run plus the CPU the server (and Redis, for Detour) spent per request."""
    url = servers.url(side)
    check_answer(url, endpoint, floor=side not in DETOURS)
    waited, busy_before = wait_for_quiet(quiet_wait_s) if quiet_wait_s > 0 else (0.0, -1.0)
    pids = servers.pids(side)
    redis_pid = servers.redis.proc.pid
    sys0, steal0 = system_cpu_s()
    cpu0, rcpu0 = [proc_cpu_s(p) for p in pids], proc_cpu_s(redis_pid)
    res = run_wrk(url, script, connections=connections, duration_s=duration_s, threads=threads)
    per_proc = [proc_cpu_s(p) - c for p, c in zip(pids, cpu0, strict=True)]
    cpu, rcpu = sum(per_proc), proc_cpu_s(redis_pid) - rcpu0
    sys1, steal1 = system_cpu_s()
    per = 1e6 / res.requests if res.requests else 0.0
    secs = res.duration_s or 1.0
    return res, {
        "server_cpu_us_per_req": cpu * per,
        "redis_cpu_us_per_req": rcpu * per if side in DETOURS else 0.0,
        "server_cores": cpu / secs,
        "redis_cores": rcpu / secs,
        "wrk_cores": res.wrk_cpu_s / secs,
        # Everything else on the machine meanwhile (the other server idling, other tenants).
        "other_cores": max(0.0, sys1 - sys0 - cpu - rcpu - res.wrk_cpu_s) / secs,
        "steal_cores": (steal1 - steal0) / secs,
        "quiet_waited_s": waited,
        "busy_cores_before": busy_before,
        # With several workers: how much of the server's CPU its busiest process took
        # (0.5 = even over 2 workers, ~1.0 = one worker got every connection).
        "busiest_process_share": max(per_proc) / cpu if cpu > 0 else 0.0,
    }


def _measure_until_clean(
    servers: Servers,
    side: str,
    endpoint: str,
    script: Path,
    *,
    repeat: int,
    connections: int,
    duration_s: int,
    threads: int,
    quiet_wait_s: float,
    noise_limit: float,
    retries: int,
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """One measurement, retried while outside load spoils it; every attempt is returned."""
    attempts: list[dict[str, Any]] = []
    for attempt in range(retries + 1):
        res, cpu = measure(
            servers,
            side,
            endpoint,
            script,
            connections=connections,
            duration_s=duration_s,
            threads=threads,
            quiet_wait_s=quiet_wait_s,
        )
        noisy = cpu["other_cores"] > noise_limit
        discarded = noisy and attempt < retries
        attempts.append({
            "workers": servers.workers, "connections": connections, "repeat": repeat,
            "attempt": attempt, "discarded": discarded, "side": side, "endpoint": endpoint,
            **res.as_dict(), **cpu,
        })  # fmt: skip
        progress(
            f"  workers={servers.workers} conns={connections} rep={repeat + 1} "
            f"{side:6} {endpoint:10} {res.rps:9.0f} req/s "
            f"p50 {res.p50_ms:6.2f} ms p99 {res.p99_ms:6.2f} ms "
            f"other {cpu['other_cores']:.2f} cores"
            + (" (discarded: outside load, again)" if discarded else "")
            + (f" ERRORS {res.errors}" if res.error_count else "")
        )
        if not discarded:
            break
    return attempts


#: One repeat: (side, endpoint) pairs, floor and Detour adjacent; the mix runs last
#: because it leaves windows open, which are reset right after it.
PLAN: tuple[tuple[str, str], ...] = (
    ("raw", "select"),
    ("floor", "select"),
    ("asgi", "select"),
    ("detour", "select"),
    ("raw", "report"),
    ("floor", "report"),
    ("asgi", "report"),
    ("detour", "report"),
    ("detour", "report-mix"),
)
#: The sides that are Detour: with the direct lane (the default) and without it.
DETOURS = ("detour", "asgi")


def _ordered(repeat: int) -> list[tuple[str, str]]:
    """Alternate the order within each raw/floor/ASGI/Detour group, repeat by repeat."""
    plan = list(PLAN)
    if repeat % 2 == 1:
        plan[0:4] = plan[3::-1]
        plan[4:8] = plan[7:3:-1]
    return plan


def run_throughput(
    *,
    workers: Sequence[int] = (1, 2),
    connections: Sequence[int] = (8, 64),
    repeats: int = 3,
    duration_s: int = 5,
    threads: int = 1,
    warmup_s: int = 1,
    quiet_wait_s: float = 30.0,
    noise_limit: float = 0.25,
    noisy_retries: int = 2,
    log_dir: Path | None = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every (workers, connections, side, endpoint) run, raw and summarised.

    A run during which something outside the benchmark used more than
    ``noise_limit`` cores is kept in the raw data as discarded and measured
    again, at most ``noisy_retries`` times; the last attempt counts regardless.
    """
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="detour-bench-") as tmp:
        scripts = {
            (side, ep): write_script(
                Path(tmp) / f"{side}-{ep}.lua", ENDPOINTS[ep][0], bodies_for(ep)
            )
            for side, ep in PLAN
        }
        for w in workers:
            with started(w, log_dir) as servers:
                if warmup_s > 0:
                    for side, ep in PLAN:
                        measure(
                            servers,
                            side,
                            ep,
                            scripts[side, ep],
                            connections=max(connections),
                            duration_s=warmup_s,
                            threads=threads,
                        )
                    with httpx.Client(base_url=servers.detour.url, timeout=5) as c:
                        reset_faults(c)
                for conns in connections:
                    for rep in range(repeats):
                        for side, ep in _ordered(rep):
                            runs += _measure_until_clean(
                                servers,
                                side,
                                ep,
                                scripts[side, ep],
                                repeat=rep,
                                connections=conns,
                                duration_s=duration_s,
                                threads=threads,
                                quiet_wait_s=quiet_wait_s,
                                noise_limit=noise_limit,
                                retries=noisy_retries,
                                progress=progress,
                            )
                            if ep == "report-mix":
                                with httpx.Client(base_url=servers.detour.url, timeout=5) as c:
                                    reset_faults(c)
    return {
        "threads": threads,
        "duration_s": duration_s,
        "repeats": repeats,
        "warmup_s": warmup_s,
        "quiet_wait_s": quiet_wait_s,
        "noise_limit_cores": noise_limit,
        "noisy_retries": noisy_retries,
        "runs": runs,
        "summary": summarise([r for r in runs if not r["discarded"]]),
    }


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def _side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "rps": _median(runs, "rps"),
        "p50_ms": _median(runs, "p50_ms"),
        "p99_ms": _median(runs, "p99_ms"),
        "server_cpu_us_per_req": _median(runs, "server_cpu_us_per_req"),
        "redis_cpu_us_per_req": _median(runs, "redis_cpu_us_per_req"),
        "server_cores": _median(runs, "server_cores"),
        "redis_cores": _median(runs, "redis_cores"),
        "wrk_cores": _median(runs, "wrk_cores"),
        "other_cores": _median(runs, "other_cores"),
        "other_cores_max": max(r["other_cores"] for r in runs),
        "busiest_process_share": _median(runs, "busiest_process_share"),
        "rps_all": [r["rps"] for r in runs],
        "p99_ms_all": [r["p99_ms"] for r in runs],
        "errors": sum(sum(r["errors"].values()) for r in runs),
    }


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over repeats, one row per (workers, connections, Detour endpoint)."""
    rows = []
    keys = sorted({(r["workers"], r["connections"]) for r in runs})
    for w, c in keys:
        for ep, (_, floor_ep) in ENDPOINTS.items():
            det = [
                r
                for r in runs
                if (r["workers"], r["connections"], r["side"], r["endpoint"])
                == (w, c, "detour", ep)
            ]
            flo = [
                r
                for r in runs
                if (r["workers"], r["connections"], r["side"], r["endpoint"])
                == (w, c, "floor", floor_ep)
            ]
            raw = [
                r
                for r in runs
                if (r["workers"], r["connections"], r["side"], r["endpoint"])
                == (w, c, "raw", floor_ep)
            ]
            lane_off = [
                r
                for r in runs
                if (r["workers"], r["connections"], r["side"], r["endpoint"]) == (w, c, "asgi", ep)
            ]
            if not det or not flo:
                continue
            d, f = _side(det), _side(flo)
            a = _side(raw) if raw else None
            o = _side(lane_off) if lane_off else None
            rows.append({
                "workers": w, "connections": c, "endpoint": ep, "floor_endpoint": floor_ep,
                "detour": d, "floor": f, "raw": a, "asgi": o,
                "ratio_asgi_raw": o["rps"] / a["rps"] if o and a and a["rps"] else 0.0,
                "ratio_rps": d["rps"] / f["rps"] if f["rps"] else 0.0,
                "ratio_raw": d["rps"] / a["rps"] if a and a["rps"] else 0.0,
            })  # fmt: skip
    return rows


def to_markdown(result: dict[str, Any]) -> str:
    label = {
        "select": "/select",
        "report": "/report-latency (< 550 ms)",
        "report-mix": "/report-latency (mix)",
    }
    lines = [
        "| workers | conns | Detour endpoint | raw ASGI req/s | floor req/s "
        "| Detour, lane off req/s | Detour req/s | Detour/raw ASGI (lane off) | Detour/floor "
        "| floor p50 / p99 ms | Detour p50 / p99 ms "
        "| server CPU µs/req raw / floor / lane off / Detour (+Redis) | errors |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["summary"]:
        d, f = row["detour"], row["floor"]
        a = row.get("raw") or {"rps": 0.0, "server_cpu_us_per_req": 0.0}
        o = row.get("asgi") or {"rps": 0.0, "server_cpu_us_per_req": 0.0, "errors": 0}
        redis = f" (+{d['redis_cpu_us_per_req']:.0f})" if row["endpoint"] != "select" else ""
        lines.append(
            f"| {row['workers']} | {row['connections']} | {label[row['endpoint']]} "
            f"| {a['rps']:,.0f} | {f['rps']:,.0f} | {o['rps']:,.0f} | {d['rps']:,.0f} "
            f"| **{row.get('ratio_raw', 0.0):.2f}x** ({row.get('ratio_asgi_raw', 0.0):.2f}x) "
            f"| {row['ratio_rps']:.2f}x "
            f"| {f['p50_ms']:.2f} / {f['p99_ms']:.2f} | {d['p50_ms']:.2f} / {d['p99_ms']:.2f} "
            f"| {a['server_cpu_us_per_req']:.0f} / {f['server_cpu_us_per_req']:.0f} "
            f"/ {o['server_cpu_us_per_req']:.0f} / {d['server_cpu_us_per_req']:.0f}{redis} "
            f"| {f['errors'] + d['errors'] + o['errors']} |"
        )
    return "\n".join(lines)


def cpu_markdown(result: dict[str, Any]) -> str:
    """Who used the 2 cores during the runs (medians), and how evenly workers shared the load."""
    lines = [
        "| workers | conns | Detour endpoint | cores used: floor server / wrk "
        "| cores used: Detour server / Redis / wrk | busiest worker's share of server CPU "
        "floor / Detour | other load on the machine, cores (max of runs) |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for row in result["summary"]:
        d, f = row["detour"], row["floor"]
        share = (
            f"{f['busiest_process_share']:.2f} / {d['busiest_process_share']:.2f}"
            if row["workers"] > 1
            else "n/a (1 process)"
        )
        lines.append(
            f"| {row['workers']} | {row['connections']} | {row['endpoint']} "
            f"| {f['server_cores']:.2f} / {f['wrk_cores']:.2f} "
            f"| {d['server_cores']:.2f} / {d['redis_cores']:.2f} / {d['wrk_cores']:.2f} "
            f"| {share} | {max(f['other_cores_max'], d['other_cores_max']):.2f} |"
        )
    return "\n".join(lines)


def verdict(result: dict[str, Any], min_ratio: float = 0.8, max_p99_ms: float = 5.0) -> list[str]:
    """The product target for /select at 8 connections, per worker count, in words."""
    out = []
    for row in result["summary"]:
        if row["endpoint"] != "select" or row["connections"] != 8:
            continue
        ratio, p99 = row["ratio_rps"], row["detour"]["p99_ms"]
        ok_ratio, ok_p99 = ratio >= min_ratio, p99 < max_p99_ms
        out.append(
            f"workers={row['workers']}: /select at {row['ratio_rps']:.2f}x the floor "
            f"(target >= {min_ratio}x: {'met' if ok_ratio else 'NOT met'}"
            + ("" if ok_ratio else f", short by {min_ratio - ratio:.2f}x")
            + "), "
            f"p99 {p99:.2f} ms (target < {max_p99_ms} ms: {'met' if ok_p99 else 'NOT met'}"
            + ("" if ok_p99 else f", over by {p99 - max_p99_ms:.2f} ms")
            + ")"
        )
    return out


# -- profile ----------------------------------------------------------------------
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")


def _frames(stack: str) -> list[tuple[str, str]]:
    out = []
    for raw in stack.split(";"):
        m = _FRAME.match(raw)
        out.append((m["func"], m["file"]) if m else (raw, ""))
    return out


def _package(file: str) -> str:
    if not file:
        return "(other)"
    top = file.split("/")[0]
    return top.removesuffix(".py")


def summarise_raw(text: str, top: int = 15) -> dict[str, Any]:
    """Self and inclusive shares from py-spy's ``--format raw`` (collapsed stacks).

    Shares are of the main thread's samples (the event loop, where requests
    are served). Stacks rooted at ``Thread._bootstrap`` belong to other threads
    (anyio's worker threads) and are counted apart: py-spy does not always see
    a thread blocked in ``Condition.wait`` as idle, so they would swamp the shares.
    """
    self_fn: Counter[str] = Counter()
    incl_fn: Counter[str] = Counter()
    self_pkg: Counter[str] = Counter()
    other_leaf: Counter[str] = Counter()
    total = other = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = _frames(stack)
        func, file = frames[-1]
        if frames[0][0] == "Thread._bootstrap":
            other += n
            other_leaf[f"{func} ({file})"] += n
            continue
        total += n
        self_fn[f"{func} ({file})"] += n
        self_pkg[_package(file)] += n
        for name in {f"{fn} ({fl})" for fn, fl in frames}:
            incl_fn[name] += n

    def shares(c: Counter[str], of: int) -> list[tuple[str, float]]:
        return [(k, v / of) for k, v in c.most_common(top)] if of else []

    return {
        "samples": total,
        "self_by_function": shares(self_fn, total),
        "self_by_package": shares(self_pkg, total),
        "inclusive_by_function": shares(incl_fn, total),
        "other_thread_samples": other,
        "other_thread_leaves": shares(other_leaf, other),
    }


def profile_select(
    out_dir: Path,
    *,
    seconds: int = 10,
    connections: int = 8,
    threads: int = 1,
    log_dir: Path | None = None,
) -> dict[str, Any]:
    """py-spy on a 1-worker Detour (its pid is the worker) while wrk loads /select.

    Two consecutive recordings under the same wrk run: ``--format raw`` (parsed
    here into shares of samples) and a flamegraph SVG, so py-spy is never
    attached twice at once. Idle samples are left out (py-spy's default), so
    ``samples / (rate * seconds)`` is roughly how busy the worker's thread was.
    """
    # Next to this interpreter (the virtualenv's bin, often not on PATH), else on PATH.
    beside = Path(sys.executable).parent / "py-spy"
    py_spy = str(beside) if beside.exists() else shutil.which("py-spy") or "py-spy"
    raw_path, svg_path = out_dir / "select-profile.txt", out_dir / "select.svg"
    with started(1, log_dir) as servers, tempfile.TemporaryDirectory() as tmp:
        script = write_script(Path(tmp) / "select.lua", "/select", [SELECT_BODY])
        pid = servers.detour.proc.pid
        check_answer(servers.detour.url, "select", floor=False)
        wrk_s = 2 * seconds + 5  # covers both recordings and py-spy's attach time
        wrk = subprocess.Popen(
            ["wrk", f"-t{threads}", f"-c{connections}", f"-d{wrk_s}s", "-s", str(script),
             servers.detour.url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            outcomes = []
            for fmt, path in (("raw", raw_path), ("flamegraph", svg_path)):
                p = subprocess.run(
                    [py_spy, "record", "--pid", str(pid), "-d", str(seconds), "--rate", "100",
                     "--format", fmt, "--nolineno", "-o", str(path)],
                    capture_output=True, text=True, timeout=seconds + 30,
                )  # fmt: skip
                outcomes.append((fmt, p.returncode, p.stderr.strip()[-500:]))
        finally:
            if wrk.poll() is None:
                wrk.terminate()
            try:
                wrk.wait(10)
            except subprocess.TimeoutExpired:
                wrk.kill()
                wrk.wait(10)
    failed = [o for o in outcomes if o[1] != 0]
    if failed or not raw_path.exists():
        return {"ok": False, "errors": failed}
    summary = summarise_raw(raw_path.read_text(), top=60)
    return {
        "ok": True,
        "seconds": seconds,
        "rate_hz": 100,
        "connections": connections,
        "raw": str(raw_path),
        "svg": str(svg_path),
        "busy_fraction": summary["samples"] / (100 * seconds),
        **summary,
    }


def profile_markdown(p: dict[str, Any]) -> str:
    if not p.get("ok"):
        return f"py-spy failed: {p.get('errors')}"
    lines = [
        f"py-spy, {p['seconds']} s at {p['rate_hz']} Hz on the single worker, wrk "
        f"{p['connections']} connections on /select: {p['samples']} non-idle samples of "
        f"the main (event-loop) thread, ~{100 * p['busy_fraction']:.0f}% of the time; shares "
        "below are of those samples. Other threads (anyio's worker threads): "
        f"{p['other_thread_samples']} samples, leaves: "
        + ", ".join(f"`{k}` {100 * v:.0f}%" for k, v in p["other_thread_leaves"][:3])
        + ".",
        "",
        "| self time, by package | share |",
        "|---|---:|",
        *[f"| {k} | {100 * v:.1f}% |" for k, v in p["self_by_package"][:10]],
        "",
        "| self time, by function | share |",
        "|---|---:|",
        *[f"| `{k}` | {100 * v:.1f}% |" for k, v in p["self_by_function"][:15]],
        "",
        "| inclusive (function on the stack) | share |",
        "|---|---:|",
        *[
            f"| `{k}` | {100 * v:.1f}% |"
            for k, v in [kv for kv in p["inclusive_by_function"] if kv[1] < 0.99][:30]
        ],
    ]
    return "\n".join(lines)
