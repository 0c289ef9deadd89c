"""``python -m bench.wake [--seconds 1.5]``: what a decision costs right after a sleep.

A producer decides, sends, then waits for its next message: its thread sleeps, and the
first microseconds after the sleep run slowly (cold caches, an idle vCPU waking). This
measures that floor for the bare in-process select (``LocalTable.select`` on a 4-broker
route, nothing of the SDK around it), for the leanest exact decision we could write (a
prototype: one lock, a kept answer, the counter, the epoch and the clock compared), for a
plain 200-iteration loop and for a call of a function that does nothing (the least any
decision costs: the floor under every design),
in a process with no other thread, in a loop and after sleeps of 0.5, 2, 5 and 30 ms (the
last: a producer thread of bench/producers.py between its sends), each case for at least
``--seconds`` and 300 calls. bench/producers.py measures the same select and the empty
call paced as its sends, each in a process of its own beside the producers;
docs/BENCHMARKS.md compares them.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable, Sequence

from detour.client import wire
from detour.client.local import LocalTable

ROUTE = {"topic": "orders", "brokers": [{"brokerName": f"broker-{c}", "writeQueueNums": 4}
                                        for c in "abcd"]}
SLEEPS_S = (0.0, 0.0005, 0.002, 0.005, 0.03)
#: Calls each case times at least, whatever its sleep (a p99 of fewer is its maximum).
MIN_CALLS = 300


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


def nothing() -> None:
    return None


class _Plan:
    """The least an exact cached decision reads: one topic's kept answers, valid for a
    select epoch and a span of the service's clock, and its round-robin counter."""

    __slots__ = ("epoch", "since", "until", "answers", "counter")

    def __init__(self, epoch: int, answers: list[tuple[object, int]]) -> None:
        self.epoch, self.since, self.until = epoch, 0, 1 << 62
        self.answers, self.counter = answers, 0


def lean_decide(table: LocalTable) -> Callable[[], object]:
    """A decision cut to that least (a prototype, not the SDK's): one lock, one dict
    lookup, the epoch and the clock compared, a kept answer and the counter stepped."""
    view, lock, plans = table.view, threading.Lock(), {}
    plans["orders"] = _Plan(view.select_epoch,
                            [(table.select("orders", None), 1) for _ in range(16)])

    def decide() -> object:
        with lock:
            plan = plans.get("orders")
            if plan is None or plan.epoch != view.select_epoch:
                return None
            now = view.now_ms()
            if not plan.since <= now < plan.until:
                return None
            kept = plan.answers[plan.counter % len(plan.answers)]
            plan.counter += kept[1]
            return kept[0]

    return decide


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wake", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=1.5, help="per case")
    args = p.parse_args(argv)
    table = LocalTable(lambda: int(time.time() * 1000), producer="wake")
    table.set_route("orders", wire.route(ROUTE))
    cases: list[tuple[str, Callable[[], object]]] = [
        ("LocalTable.select", lambda: table.select("orders", None)),
        ("the leanest exact decision (prototype)", lean_decide(table)),
        ("200-iteration loop", loop200),
        ("an empty call", nothing),
    ]
    print("| what | sleep before each call | calls | p50 µs | p99 µs |")
    print("|---|---:|---:|---:|---:|")
    for name, fn in cases:
        for sleep_s in SLEEPS_S:
            us = timed_after(fn, sleep_s, max(args.seconds, MIN_CALLS * sleep_s * 1.1))
            print(f"| {name} | {sleep_s * 1000:g} ms | {len(us):,} | {us[len(us) // 2]:.1f} | "
                  f"{us[min(len(us) - 1, int(0.99 * len(us)))]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
