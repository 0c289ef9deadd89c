"""``python -m bench.wake [--seconds 1.5]``: what a decision costs right after a sleep.

A producer decides, sends, then waits for its next message: its thread sleeps, and the
first microseconds after the sleep run slowly (cold caches, an idle vCPU waking). This
measures that floor for the bare in-process select (``LocalTable.select`` on a 4-broker
route, nothing of the SDK around it) and for a plain 200-iteration loop, in a process with
no other thread, in a loop and after sleeps of 0.5 and 5 ms. bench/producers.py measures
the same select paced as its sends, beside them; docs/BENCHMARKS.md compares the two.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from detour.client import wire
from detour.client.local import LocalTable

ROUTE = {"topic": "orders", "brokers": [{"brokerName": f"broker-{c}", "writeQueueNums": 4}
                                        for c in "abcd"]}
SLEEPS_S = (0.0, 0.0005, 0.005)


def timed_after(fn: Callable[[], object], sleep_s: float, seconds: float) -> list[float]:
    """µs of each call of ``fn``, each after a sleep of ``sleep_s`` (none: back to back)."""
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000)
        if sleep_s:
            time.sleep(sleep_s)
    return sorted(out)


def loop200() -> int:
    total = 0
    for i in range(200):
        total += i
    return total


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wake", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=1.5, help="per case")
    args = p.parse_args(argv)
    table = LocalTable(lambda: int(time.time() * 1000), producer="wake")
    table.set_route("orders", wire.route(ROUTE))
    cases: list[tuple[str, Callable[[], object]]] = [
        ("LocalTable.select", lambda: table.select("orders", None)),
        ("200-iteration loop", loop200),
    ]
    print("| what | sleep before each call | calls | p50 µs | p99 µs |")
    print("|---|---:|---:|---:|---:|")
    for name, fn in cases:
        for sleep_s in SLEEPS_S:
            us = timed_after(fn, sleep_s, args.seconds)
            print(f"| {name} | {sleep_s * 1000:g} ms | {len(us):,} | {us[len(us) // 2]:.1f} | "
                  f"{us[min(len(us) - 1, int(0.99 * len(us)))]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
