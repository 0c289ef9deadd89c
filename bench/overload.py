"""Overload: offer 5x the service's capacity and see whether it fails fast.

``python -m bench.overload`` (``make bench-overload``). For each endpoint (``/select`` on
the memory store, ``/report-latency`` on Redis), in one invocation:

1. **capacity**: wrk, closed-loop, 16 connections: the most requests per second the
   service answers (the baseline the factor is applied to, measured in the same run);
2. **under**: an open-loop Poisson load at half that rate: the latency of a service
   with room to spare;
3. **over**: the same generator at ``--factor`` (5) times the capacity.

The open-loop generator is ``bench/overload_gen.js`` (Node: a Python client could not
offer 5x a Python server's capacity from the other core). Each connection carries one
request at a time, like a producer's HTTP client; a request due while its connection is
busy waits, and that wait is part of its latency (no coordinated omission). The verdict
is the issue's bar: answered requests keep p99 under 50 ms, refusals (503 SYSTEM_BUSY)
come back in under 5 ms. Medians over ``--runs`` runs; the machine is checked for quiet
before each phase and the idle CPU recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.cgroup import CpuCap
from bench.loadgen import run_wrk, wait_for_quiet, write_script
from bench.refusal_floor import running
from tests.procs import RedisServer, ServiceProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
GENERATOR = ROOT / "bench" / "overload_gen.js"
OUT = ROOT / "bench" / "out"
_MARK = "OVERLOAD_JSON "
BAR_OK_P99_MS = 50.0
BAR_BUSY_P99_MS = 5.0

SELECT_BODY = {"topic": "orders"}
REPORT_BODY = {"brokerName": "broker-a", "latencyMs": 7}
ROUTE = {"brokers": [{"brokerName": f"broker-{c}", "writeQueueNums": 4} for c in "abcd"]}


@dataclass(frozen=True)
class Endpoint:
    name: str
    path: str
    body: dict[str, Any]
    redis: bool


ENDPOINTS = {
    "select": Endpoint("select", "/select", SELECT_BODY, redis=False),
    "report": Endpoint("report", "/report-latency", REPORT_BODY, redis=True),
}


def offer(port: int, ep: Endpoint, rate: float, conns: int, duration_s: int,
          seed: int) -> dict[str, Any]:
    """One open-loop run of the Node generator; its JSON summary."""
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("node not found (Node 20 is part of this machine's toolset)")
    args = [node, str(GENERATOR), "--port", str(port), "--path", ep.path,
            "--body", json.dumps(ep.body), "--rate", str(int(rate)), "--conns", str(conns),
            "--duration", str(duration_s), "--warmup", "1", "--seed", str(seed)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=duration_s + 60)
    line = next((x for x in out.stdout.splitlines() if x.startswith(_MARK)), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"generator failed ({out.returncode}): {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(line[len(_MARK):])
    return result


def capacity(url: str, ep: Endpoint, duration_s: int, work: Path) -> float:
    """Answers per second that were not refusals (a refusal is cheap: counting it would
    inflate the capacity the overload factor multiplies)."""
    script = write_script(work / f"{ep.name}.lua", ep.path, [ep.body])
    r = run_wrk(url, script, connections=16, duration_s=duration_s)
    return (r.requests - r.errors.get("status", 0)) / r.duration_s


def run_endpoint(ep: Endpoint, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    redis = RedisServer() if ep.redis else None
    env = {}
    if args.max_in_flight is not None:
        env["DETOUR_MAX_IN_FLIGHT"] = str(args.max_in_flight)
    if args.turn_budget_ms is not None:
        env["DETOUR_TURN_BUDGET_MS"] = str(args.turn_budget_ms)
    try:
        runs = []
        for i in range(args.runs):
            # A fresh process per run: an overload leaves the service shedding until
            # load falls, which would cut the next run's capacity measurement short.
            with contextlib.ExitStack() as stack:
                svc = stack.enter_context(
                    ServiceProcess(redis_url=redis.url if redis else None, env=env))
                throttled: dict[str, int] = {}
                if args.cpu_quota_us:
                    cpu = stack.enter_context(CpuCap(args.cpu_quota_us, args.cpu_period_us))
                    cpu.add(svc.proc.pid)
                httpx.put(f"{svc.url}/routes/orders", json=ROUTE, timeout=5).raise_for_status()
                quiet = wait_for_quiet(30)
                cap = capacity(svc.url, ep, args.duration, work)
                under = offer(svc.port, ep, cap / 2, args.conns, args.duration, seed=2 * i + 1)
                wait_for_quiet(30)
                # A fixed rate compares code versions at the same load (their measured
                # capacities differ run to run on a busy machine).
                rate = args.over_rate or cap * args.factor
                over = offer(svc.port, ep, rate, args.conns, args.duration, seed=2 * i + 2)
                shed = shed_counts(svc.url)
                if args.cpu_quota_us:
                    throttled = cpu.throttled()
            run: dict[str, Any] = {"capacity_rps": cap, "under": under, "over": over,
                   "busy_cores_before": quiet[1], "shed_total": shed, "throttled": throttled}
            print(f"{ep.name} run {i + 1}: capacity {cap:.0f}/s; over: "
                  f"ok p99 {over['ok']['p99_ms']} ms, busy p99 {over['busy']['p99_ms']} ms; "
                  f"refusals by reason {shed}", file=sys.stderr)
            if args.floor:
                wait_for_quiet(30)
                floor = run["floor"] = floor_over(ep, rate, args, seed=2 * i + 2)
                print(f"{ep.name} run {i + 1}: refusal floor at {rate:.0f}/s: busy p99 "
                      f"{floor['busy']['p99_ms']} ms", file=sys.stderr)
            runs.append(run)
    finally:
        if redis:
            redis.stop()
    return {"endpoint": ep.name, "runs": runs}


def floor_over(ep: Endpoint, rate: float, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The over phase's load, offered to the refusal floor under the same cap.

    ``bench/refusal_floor.py`` refuses every request and does nothing else, on the same
    server machinery: a rate it cannot refuse within the bar, no shedding policy on this
    stack can."""
    port = free_port()
    with running(port) as proc, contextlib.ExitStack() as stack:
        if args.cpu_quota_us:
            stack.enter_context(CpuCap(args.cpu_quota_us, args.cpu_period_us)).add(proc.pid)
        return offer(port, ep, rate, args.conns, args.duration, seed)


def shed_counts(url: str) -> dict[str, float]:
    """Refusals by reason over the whole run, from the service's own counter."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {s.labels["reason"]: s.value
            for family in text_string_to_metric_families(text)
            if family.name == "detour_requests_shed"
            for s in family.samples if s.name == "detour_requests_shed_total"}


def _median(runs: Sequence[dict[str, Any]], *path: str) -> float | None:
    values = []
    for r in runs:
        v: Any = r
        for k in path:
            v = v[k]
        if v is not None:
            values.append(float(v))
    return statistics.median(values) if values else None


def _fmt(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def _settings_text(args: argparse.Namespace) -> str:
    given = [f"`DETOUR_MAX_IN_FLIGHT={args.max_in_flight}`" if args.max_in_flight else "",
             f"`DETOUR_TURN_BUDGET_MS={args.turn_budget_ms}`"
             if args.turn_budget_ms is not None else ""]
    if args.cpu_quota_us:
        given.append(f"Detour's CPU capped by a cgroup at {args.cpu_quota_us} µs per "
                     f"{args.cpu_period_us} µs ({args.cpu_quota_us / args.cpu_period_us:.2f} "
                     "cores)")
    return ", ".join(g for g in given if g) or "the service's default settings"


def markdown(results: Sequence[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    lines = [
        "## Overload: 5x capacity, fail fast",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d')}; medians of {args.runs} runs of "
        f"{args.duration} s; {args.conns} connections, one request at a time each; "
        f"{_settings_text(args)}). Capacity is wrk's closed-loop "
        "rate at 16 connections in the same run; *under* offers half of it, *over* "
        f"{args.factor}x, as Poisson arrivals (`bench/overload_gen.js`). Latency is from when "
        "a request was due (waiting for a busy connection included); *wire* is from when it "
        "was sent.",
        "",
        "| endpoint | capacity /s | load | offered /s | answered 2xx /s | refused 503 /s "
        "| 2xx p50 / p99 ms | 503 p50 / p99 ms | 2xx p99 wire ms | 503 p99 wire ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for res in results:
        runs = res["runs"]
        cap = _median(runs, "capacity_rps")
        for load in ("under", "over"):
            ok_rate = _median([{"v": r[load]["ok"]["count"] / r[load]["duration_s"]}
                               for r in runs], "v")
            busy_rate = _median([{"v": r[load]["busy"]["count"] / r[load]["duration_s"]}
                                 for r in runs], "v")
            lines.append(
                f"| `{res['endpoint']}` | {_fmt(cap, 0)} | {load} "
                f"| {_fmt(_median(runs, load, 'offered_rps'), 0)} | {_fmt(ok_rate, 0)} "
                f"| {_fmt(busy_rate, 0)} "
                f"| {_fmt(_median(runs, load, 'ok', 'p50_ms'))} / "
                f"{_fmt(_median(runs, load, 'ok', 'p99_ms'))} "
                f"| {_fmt(_median(runs, load, 'busy', 'p50_ms'))} / "
                f"{_fmt(_median(runs, load, 'busy', 'p99_ms'))} "
                f"| {_fmt(_median(runs, load, 'wire', 'ok', 'p99_ms'))} "
                f"| {_fmt(_median(runs, load, 'wire', 'busy', 'p99_ms'))} |"
            )
        floor_verdict = None
        if all("floor" in r for r in runs):
            fl = [r["floor"] for r in runs]

            def rate(outcome: str, fl: list[dict[str, Any]] = fl) -> float | None:
                return _median([{"v": f[outcome]["count"] / f["duration_s"]} for f in fl], "v")

            lines.append(
                f"| refusal floor | — | over | {_fmt(_median(fl, 'offered_rps'), 0)} "
                f"| {_fmt(rate('ok'), 0)} | {_fmt(rate('busy'), 0)} | — "
                f"| {_fmt(_median(fl, 'busy', 'p50_ms'))} / "
                f"{_fmt(_median(fl, 'busy', 'p99_ms'))} "
                f"| — | {_fmt(_median(fl, 'wire', 'busy', 'p99_ms'))} |"
            )
            floor99 = _median(fl, "busy", "p99_ms")
            floor_verdict = (
                f"- the refusal floor at the same load: refusals p99 {_fmt(floor99)} ms "
                f"({'meets' if floor99 is not None and floor99 < BAR_BUSY_P99_MS else 'misses'}"
                f" < {BAR_BUSY_P99_MS:.0f} ms)."
            )
        ok99 = _median(runs, "over", "ok", "p99_ms")
        busy99 = _median(runs, "over", "busy", "p99_ms")
        verdicts.append(
            f"- `{res['endpoint']}` at {args.factor}x: answered p99 {_fmt(ok99)} ms "
            f"({'meets' if ok99 is not None and ok99 < BAR_OK_P99_MS else 'misses'} "
            f"< {BAR_OK_P99_MS:.0f} ms), refusals p99 {_fmt(busy99)} ms "
            f"({'meets' if busy99 is not None and busy99 < BAR_BUSY_P99_MS else 'misses'} "
            f"< {BAR_BUSY_P99_MS:.0f} ms)."
        )
        if floor_verdict:
            verdicts.append(floor_verdict)
    return "\n".join([*lines, "", *verdicts, ""])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__)
    p.add_argument("--endpoints", default="select,report")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--duration", type=int, default=5, help="seconds per phase")
    p.add_argument("--factor", type=float, default=5.0)
    p.add_argument("--conns", type=int, default=512)
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="DETOUR_MAX_IN_FLIGHT (default: the service's, 256)")
    p.add_argument("--turn-budget-ms", type=float, default=None,
                   help="DETOUR_TURN_BUDGET_MS (default: the service's, 0.5)")
    p.add_argument("--cpu-quota-us", type=int, default=None,
                   help="cap Detour's CPU with a cgroup: this quota per period (root; "
                        "1000 with --cpu-period-us 3333 is 0.3 cores)")
    p.add_argument("--cpu-period-us", type=int, default=3333)
    p.add_argument("--over-rate", type=float, default=None,
                   help="offer this many requests/s in the over phase instead of "
                        "--factor x the measured capacity")
    p.add_argument("--floor", action="store_true",
                   help="also offer each over phase's load to the refusal floor "
                        "(bench/refusal_floor.py) under the same cap")
    p.add_argument("--markdown", type=Path, help="also write the section to this file")
    args = p.parse_args(argv)
    given = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python -m bench.overload", *given])
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_endpoint(ENDPOINTS[e], args, Path(tmp))
                   for e in args.endpoints.split(",")]
    (OUT / "overload.json").write_text(json.dumps(results, indent=1))
    section = markdown(results, args, command)
    if args.markdown:
        args.markdown.write_text(section)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
