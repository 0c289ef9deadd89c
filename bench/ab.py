"""A/B: POST /select (or /report-latency) served by two source trees, interleaved.

    .venv/bin/python -m bench.ab --a /tmp/detour-main --rounds 5 --duration 8

Starts ``python -m service`` (memory store, 1 worker) from tree A (the baseline, e.g.
``git archive main``) and from tree B (this repository by default), registers the same
route on both, then runs wrk against A and B in turn, ``--rounds`` times, alternating
which goes first, so the machine's drift hits both alike. Prints each round's req/s and
p99, the B/A ratio per round and the median ratio, as JSON and as a Markdown line for
docs/BENCHMARKS.md. Loopback only, bounded by rounds x duration.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.loadgen import proc_cpu_s, process_tree, run_wrk, wait_for_quiet, write_script
from bench.throughput import BROKERS, QUEUES_PER_BROKER, SELECT_BODY, TOPIC, steady_reports
from tests.procs import free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def serve(tree: Path) -> Iterator[tuple[str, int]]:
    """``python -m service`` run from ``tree`` (its ``service`` package), on a free port."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--port", str(port), "--workers", "1",
         "--log-level", "warning"],
        cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/readyz", timeout=1).status_code == 200, 60, url)
        brokers = [{"brokerName": b, "writeQueueNums": QUEUES_PER_BROKER} for b in BROKERS]
        httpx.put(f"{url}/routes/{TOPIC}", json={"brokers": brokers}, timeout=5).raise_for_status()
        yield url, proc.pid
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="baseline source tree")
    parser.add_argument("--b", type=Path, default=ROOT, help="candidate source tree")
    parser.add_argument("--endpoint", choices=("select", "report"), default="select")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=int, default=8, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, default=8)
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 20 or not 1 <= args.duration <= 60:
        parser.error("rounds 1..20, duration 1..60 s")
    with tempfile.TemporaryDirectory(prefix="detour-ab-") as tmp:
        if args.endpoint == "select":
            script = write_script(Path(tmp) / "ab.lua", "/select", [SELECT_BODY])
        else:
            script = write_script(Path(tmp) / "ab.lua", "/report-latency", steady_reports())
        rounds: list[dict[str, float]] = []
        with serve(args.a) as (url_a, pid_a), serve(args.b) as (url_b, pid_b):
            sides = {"a": (url_a, pid_a), "b": (url_b, pid_b)}
            for url, _ in sides.values():  # warm-up
                run_wrk(url, script, connections=args.connections, duration_s=2)
            for i in range(args.rounds):
                row: dict[str, float] = {}
                for side in ("a", "b") if i % 2 == 0 else ("b", "a"):
                    url, pid = sides[side]
                    wait_for_quiet(5)
                    pids = process_tree(pid)
                    cpu = sum(proc_cpu_s(p) for p in pids)
                    r = run_wrk(url, script, connections=args.connections, duration_s=args.duration)
                    cpu = sum(proc_cpu_s(p) for p in pids) - cpu
                    # Non-2xx answers (the shedder's fast 503 on a crowded machine) are
                    # not counted as served.
                    ok = r.requests - r.error_count
                    row[f"{side}_rps"], row[f"{side}_p99_ms"] = ok / r.duration_s, r.p99_ms
                    row[f"{side}_cpu_us"] = cpu / max(1, r.requests) * 1e6
                    row[f"{side}_refused"] = r.error_count
                row["ratio"] = row["b_rps"] / row["a_rps"]
                # CPU per request, A over B: > 1 when B spends less (less noisy than req/s
                # on a shared machine, where the server waits for a core)
                row["cpu_ratio"] = row["a_cpu_us"] / row["b_cpu_us"]
                rounds.append(row)
                print(json.dumps({"round": i, **row}), flush=True)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(json.dumps({"median": med}))
    print(
        f"| /{args.endpoint} | {args.rounds} x {args.duration} s, -c{args.connections} | "
        f"{med['a_rps']:,.0f} / {med['b_rps']:,.0f} | **{med['ratio']:.3f}x** | "
        f"{med['a_cpu_us']:.0f} / {med['b_cpu_us']:.0f} | **{med['cpu_ratio']:.3f}x** | "
        + ", ".join(f"{r['ratio']:.2f}" for r in rounds)
        + " |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
