"""``python -m bench.client``: what the producer SDK's cached mode costs and how fast it learns.

Two numbers, each against its target:

* **select cost**: a cached ``DetourClient.select`` decides in-process; target
  under 10 µs. Each run times N back-to-back calls with ``time.perf_counter_ns``
  around the whole loop (so the timer's own cost is not in it) and divides; the
  median of the runs is the figure. Next to it, the same loop over a bare
  ``detour.strategy.select`` call on the same route and table: the floor the
  SDK's locking, clock and counter add to. The table does not change during the
  loop, so after the first lap the cached select answers from its kept answers
  (``detour.memo``); ``python -m bench.client_steps`` has the cost of each
  step and of a select that decides in full. The route has 4 brokers x 8
  queues with one broker avoided, so walks skip over it. The async client's
  ``await select`` and a remote-mode select (one HTTP round trip) are shown for
  scale.
* **propagation**: a report made through one cached client is obeyed by another
  cached client's select; target p99 under 100 ms. The route has two brokers
  with one queue each, T and H; the observer selects with ``last_broker=H``, so
  it answers T while T is available and H once it has seen T's isolation,
  wherever its round-robin counter is. A trial: client A reports T isolated,
  the observer B polls (a select every 0.1 ms, sleeping in between so the
  clients' background threads get the GIL) until it avoids T; the time is from
  A's ``report`` call to B's first avoiding answer. Then an operator restore
  (``DELETE /fault-items/T``) and a wait until both clients use T again, so
  every trial starts from the same state. Run with both clients on one Detour
  replica, and with each on its own replica of one Redis (the sidecar layout,
  through Redis pub/sub).

Real processes on 127.0.0.1 only: a redis-server and two Detour replicas on it,
started and stopped here. Bounded: every wait has a deadline, a trial that
misses it counts as a miss. Writes ``client.json`` (every run, raw) and
``client.md`` (the tables) under ``--out`` and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from detour import strategy
from detour.client import AsyncDetourClient, DetourClient
from tests.procs import RedisServer, ServiceProcess, wait_until

SELECT_TOPIC = "bench-select"
PROPAGATION_TOPIC = "bench-propagation"
T, H = "bench-t", "bench-h"
SELECT_TARGET_US = 10.0
PROPAGATION_TARGET_MS = 100.0
#: The longest a trial waits for the observer before counting a miss (s).
TRIAL_TIMEOUT_S = 2.0
POLL_S = 0.0001


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.client", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=100_000, help="selects per timed run (100000)")
    p.add_argument("--runs", type=int, default=7, help="timed runs per select variant (7)")
    p.add_argument("--remote-calls", type=int, default=2000, help="remote selects timed (2000)")
    p.add_argument("--trials", type=int, default=200, help="propagation trials per layout (200)")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="output directory")
    p.add_argument("--quick", action="store_true", help="smoke run: 10k calls, 3 runs, 30 trials")
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.runs, args.remote_calls, args.trials = 10_000, 3, 200, 30
    for name in ("calls", "runs", "remote_calls", "trials"):
        if not 1 <= getattr(args, name) <= 10_000_000:
            p.error(f"--{name.replace('_', '-')} must be 1..10000000")
    return args


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest rank: the smallest value with at least p% of the values at or below it."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def put_routes(url: str) -> None:
    with httpx.Client(base_url=url, timeout=5) as c:
        c.put(f"/routes/{SELECT_TOPIC}", json={"brokers": [
            {"brokerName": f"bench-{x}", "writeQueueNums": 8, "address": f"10.0.0.{i}:10911"}
            for i, x in enumerate("abcd", 1)]}).raise_for_status()
        c.put(f"/routes/{PROPAGATION_TOPIC}", json={"brokers": [
            {"brokerName": T, "writeQueueNums": 1}, {"brokerName": H, "writeQueueNums": 1}]},
        ).raise_for_status()
        c.post("/report-latency", json={"brokerName": "bench-b", "latencyMs": 0,
                                        "isolation": True}).raise_for_status()


# ---------------------------------------------------------------- select cost


def time_loop(fn: Callable[[], object], calls: int) -> float:
    """Mean ns per call over ``calls`` back-to-back calls."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def bare_strategy(client: DetourClient) -> Callable[[], object]:
    """A bare ``strategy.select`` on the client's own route and table, counter carried."""
    view = client._core.table.view
    route, faults, now = view.routes[SELECT_TOPIC], view.faults, view.now_ms()
    counter = [0]
    select = strategy.select

    def call() -> object:
        sel = select(route, counter[0], faults, now, None, True)
        counter[0] = sel.next_counter
        return sel

    return call


def measure_select(url: str, calls: int, runs: int, remote_calls: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with DetourClient(url, mode="cached") as client:
        if not client.wait_ready(10):
            raise RuntimeError("cached client never got a snapshot")
        wait_until(lambda: client.select(SELECT_TOPIC).avoided_brokers
                   or client.select(SELECT_TOPIC).broker_name != "bench-b", 5, "table")
        variants: dict[str, Callable[[], object]] = {
            "strategy.select (bare)": bare_strategy(client),
            "DetourClient.select (cached)": lambda: client.select(SELECT_TOPIC),
        }
        for fn in variants.values():
            time_loop(fn, min(calls, 10_000))  # warm-up, discarded
        per_run: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(runs):  # interleaved, so drift hits both alike
            for name, fn in variants.items():
                per_run[name].append(time_loop(fn, calls))
        single: list[float] = []
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            client.select(SELECT_TOPIC)
            single.append(time.perf_counter_ns() - t0)
        out["sync"] = per_run
        out["cached_single_call_ns"] = {
            "p50": percentile(single, 50), "p99": percentile(single, 99), "max": max(single)}

    async def async_runs() -> list[float]:
        async with AsyncDetourClient(url, mode="cached") as aclient:
            if not await aclient.wait_ready(10):
                raise RuntimeError("async cached client never got a snapshot")
            results = []
            for r in range(runs + 1):
                start = time.perf_counter_ns()
                for _ in range(calls):
                    await aclient.select(SELECT_TOPIC)
                if r:  # the first is the warm-up
                    results.append((time.perf_counter_ns() - start) / calls)
            return results

    out["async"] = asyncio.run(async_runs())
    with DetourClient(url, timeout=2.0) as remote:
        remote.select(SELECT_TOPIC)
        rtts = []
        for _ in range(remote_calls):
            t0 = time.perf_counter_ns()
            remote.select(SELECT_TOPIC)
            rtts.append(time.perf_counter_ns() - t0)
        out["remote_single_call_ns"] = {
            "p50": percentile(rtts, 50), "p99": percentile(rtts, 99), "max": max(rtts)}
    return out


# ---------------------------------------------------------------- propagation


def _sees(client: DetourClient, avoided: bool) -> bool:
    broker = client.select(PROPAGATION_TOPIC, last_broker=H).broker_name
    return broker == (H if avoided else T)


def _poll(client: DetourClient, avoided: bool, deadline: float) -> float | None:
    while time.perf_counter() < deadline:
        if _sees(client, avoided):
            return time.perf_counter()
        time.sleep(POLL_S)
    return None


def measure_propagation(reporter_url: str, observer_url: str, admin_url: str,
                        trials: int) -> dict[str, Any]:
    delays_ms: list[float] = []
    misses = 0
    with DetourClient(reporter_url, mode="cached") as a, \
            DetourClient(observer_url, mode="cached") as b, \
            httpx.Client(base_url=admin_url, timeout=5) as admin:
        if not (a.wait_ready(10) and b.wait_ready(10)):
            raise RuntimeError("cached clients never got a snapshot")
        admin.delete(f"/fault-items/{T}")
        wait_until(lambda: _sees(a, False) and _sees(b, False), 5, "a clean start")
        for _ in range(trials):
            start = time.perf_counter()
            a.report(T, 0, isolation=True)
            seen = _poll(b, True, start + TRIAL_TIMEOUT_S)
            if seen is None:
                misses += 1
            else:
                delays_ms.append((seen - start) * 1000)
            wait_until(lambda: a.stats().pending_reports == 0, 5, "the report sent")
            admin.delete(f"/fault-items/{T}").raise_for_status()
            wait_until(lambda: _sees(a, False) and _sees(b, False), 5, "the restore")
        stats = {"reporter": a.stats().__repr__(), "observer": b.stats().__repr__()}
    return {
        "trials": trials,
        "misses": misses,
        "delays_ms": delays_ms,
        "p50": percentile(delays_ms, 50),
        "p99": percentile(delays_ms, 99),
        "max": max(delays_ms, default=math.nan),
        "clients": stats,
    }


# ---------------------------------------------------------------- report


def render(results: dict[str, Any], command: str) -> str:
    sel = results["select"]
    med = {name: statistics.median(v) for name, v in sel["sync"].items()}
    rows = [
        "| select | median ns/call | runs (ns/call) | target |",
        "|---|---:|---|---|",
    ]
    for name, runs in sel["sync"].items():
        target = ""
        if "cached" in name:
            ok = med[name] / 1000 < SELECT_TARGET_US
            target = f"< {SELECT_TARGET_US:.0f} µs: {'met' if ok else 'MISSED'}"
        rows.append(f"| `{name}` | {med[name]:,.0f} | "
                    f"{', '.join(f'{x:,.0f}' for x in runs)} | {target} |")
    a = sel["async"]
    rows.append(f"| `await AsyncDetourClient.select (cached)` | {statistics.median(a):,.0f} | "
                f"{', '.join(f'{x:,.0f}' for x in a)} | |")
    single, remote = sel["cached_single_call_ns"], sel["remote_single_call_ns"]
    lines = [
        f"Run {results['when']} on {results['machine']}; `{command}`.",
        "",
        *rows,
        "",
        f"Cached select, each call timed alone (timer cost included): p50 "
        f"{single['p50']:,.0f} ns, p99 {single['p99']:,.0f} ns, max {single['max'] / 1000:,.0f} "
        f"µs. For scale, a remote-mode select (HTTP to Detour on loopback): p50 "
        f"{remote['p50'] / 1000:,.0f} µs, p99 {remote['p99'] / 1000:,.0f} µs.",
        "",
        "| propagation (report by A, obeyed by B's select) | trials | misses | p50 ms | p99 ms "
        "| max ms | target p99 < 100 ms |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for layout, r in results["propagation"].items():
        ok = r["misses"] == 0 and r["p99"] < PROPAGATION_TARGET_MS
        lines.append(f"| {layout} | {r['trials']} | {r['misses']} | {r['p50']:.2f} | "
                     f"{r['p99']:.2f} | {r['max']:.2f} | {'met' if ok else 'MISSED'} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m bench.client" + (" " + " ".join(argv or sys.argv[1:])).rstrip()
    results: dict[str, Any] = {
        "when": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                   f"{platform.python_version()}",
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    with ExitStack() as stack:
        redis = RedisServer()
        stack.callback(redis.stop)
        one = ServiceProcess(redis_url=redis.url)
        stack.callback(one.stop)
        two = ServiceProcess(redis_url=redis.url)
        stack.callback(two.stop)
        put_routes(one.url)
        wait_until(lambda: httpx.get(f"{two.url}/routes/{PROPAGATION_TOPIC}",
                                     timeout=1).status_code == 200, 5, "routes on replica 2")
        results["select"] = measure_select(one.url, args.calls, args.runs, args.remote_calls)
        results["propagation"] = {
            "both clients on one replica": measure_propagation(
                one.url, one.url, one.url, args.trials),
            "each client on its own replica (via Redis)": measure_propagation(
                one.url, two.url, one.url, args.trials),
        }
    md = render(results, command)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "client.json").write_text(json.dumps(results, indent=2, default=str))
    (args.out / "client.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
