"""Efficacy of the queue choice: round_robin against p2c-ewma on simulated brokers.

A real Detour (memory store, its own process on 127.0.0.1) is driven through the
HTTP API as producers would: each send asks ``POST /select``, takes a latency drawn
for the chosen broker from a seeded distribution (no broker is contacted: the
brokers are simulated), and reports it with ``POST /report-latency``. Every scenario
runs once per ``selection`` with the same seed, each on a fresh Detour process (no latency
score carries over), so both modes face the same brokers from the same start.

Scenarios (latency medians in ms; each draw is the median times a log-normal factor):

* ``one-slow``: 5, 8, 12 and 300 ms. 300 ms is below the 550 ms tier, so RocketMQ's
  avoidance never opens a window: round-robin keeps sending a quarter of the traffic
  to the slow broker.
* ``gradient``: 5, 20, 60 and 150 ms.
* ``degrades``: all at 10 ms; broker-d goes to 400 ms after a third of the sends.

Usage::

    .venv/bin/python -m bench.selection --sends 3000 --out bench-selection.json

Prints a Markdown table; ``--out`` also writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.propagation import distribution
from tests.procs import ServiceProcess

TOPIC = "selection"
BROKERS = ("broker-a", "broker-b", "broker-c", "broker-d")
#: The log-normal spread of every draw (sigma of the underlying normal).
SIGMA = 0.35

Medians = Callable[[int, int], dict[str, float]]
SCENARIOS: dict[str, Medians] = {
    "one-slow": lambda i, n: dict(zip(BROKERS, (5.0, 8.0, 12.0, 300.0), strict=True)),
    "gradient": lambda i, n: dict(zip(BROKERS, (5.0, 20.0, 60.0, 150.0), strict=True)),
    "degrades": lambda i, n: {
        **dict.fromkeys(BROKERS, 10.0),
        "broker-d": 400.0 if i >= n // 3 else 10.0,
    },
}


def run_mode(
    http: httpx.Client, selection: str, scenario: str, sends: int, seed: int
) -> dict[str, Any]:
    """``sends`` select-then-report rounds; the latencies the simulated sends took."""
    http.patch("/config", json={"selection": selection}).raise_for_status()
    http.put(
        f"/routes/{TOPIC}",
        json={"brokers": [{"brokerName": b, "writeQueueNums": 4} for b in BROKERS]},
    ).raise_for_status()
    rng = random.Random(seed)
    medians = SCENARIOS[scenario]
    latencies: list[float] = []
    shares: Counter[str] = Counter()
    for i in range(sends):
        broker = http.post("/select", json={"topic": TOPIC}).json()["brokerName"]
        latency = medians(i, sends)[broker] * math.exp(rng.gauss(0, SIGMA))
        latencies.append(latency)
        shares[broker] += 1
        http.post(
            "/report-latency",
            json={"brokerName": broker, "latencyMs": latency, "producer": "bench"},
        ).raise_for_status()
    return {
        "selection": selection,
        "scenario": scenario,
        "latency_ms": distribution(latencies),
        "share": {b: shares[b] / sends for b in BROKERS},
    }


def markdown(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| scenario | selection | mean ms | p50 ms | p99 ms | share a / b / c / d |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in results:
        d = r["latency_ms"]
        share = " / ".join(f"{100 * r['share'][b]:.0f} %" for b in BROKERS)
        lines.append(
            f"| {r['scenario']} | {r['selection']} | {d['mean']:.1f} | {d['p50']:.1f} | "
            f"{d['p99']:.1f} | {share} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sends", type=int, default=3000, help="sends per scenario and mode")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if not 1 <= args.sends <= 1_000_000:
        parser.error("--sends must be 1..1000000")
    results = []
    for scenario in args.scenarios:
        for selection in ("round_robin", "p2c-ewma"):
            # A fresh process per run: no latency score carries over from the last one.
            service = ServiceProcess()
            try:
                with httpx.Client(base_url=service.url, timeout=10) as http:
                    results.append(run_mode(http, selection, scenario, args.sends, args.seed))
            finally:
                service.stop()
    print(markdown(results))
    if args.out:
        args.out.write_text(json.dumps({"sends": args.sends, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
