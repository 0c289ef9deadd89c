"""``python -m bench.client_steps``: where a cached select's time goes, step by step, in-process.

The table of ``python -m bench.client`` (4 brokers x 8 queues, one broker's window open,
the service's default profile) put straight into a cached client's copy, no Detour: the
client's stream points at a closed port on 127.0.0.1 and is marked synced by hand. Each
step runs ``--calls`` times per run, ``--runs`` runs interleaved; the figure is the median
of the runs, in CPU ns per call (``time.thread_time_ns``: a busy machine's other tenants
inflate it less than wall clock). Each step is timed on its own, the loop and the call
included (the "empty call" row). Then a producer's pattern: a select and a healthy report
of the chosen broker, against the report alone. Runs on an older tree too (``PYTHONPATH``
to it, the script by its path), for a before and after.

Prints a Markdown table; ``--out`` also writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from detour import strategy
from detour.client import DetourClient, wire
from detour.model import FaultItem
from detour.profiles import PROFILES
from tests.procs import free_port

TOPIC = "bench-select"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.client_steps", description=__doc__)
    p.add_argument("--calls", type=int, default=100_000, help="calls per run (100000)")
    p.add_argument("--runs", type=int, default=7, help="runs per step (7)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="recommended")
    p.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = p.parse_args(argv)
    for name in ("calls", "runs"):
        if not 1 <= getattr(args, name) <= 10_000_000:
            p.error(f"--{name} must be 1..10000000")
    return args


def cpu_ns(fn: Callable[[], object], calls: int) -> float:
    start = time.thread_time_ns()
    for _ in range(calls):
        fn()
    return (time.thread_time_ns() - start) / calls


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("detour.client").setLevel(logging.CRITICAL)  # the stream's retries
    client = DetourClient(f"http://127.0.0.1:{free_port()}", mode="cached", producer="p1")
    try:
        core = client._core
        table, view = core.table, core.table.view
        route = wire.route(
            {
                "topic": TOPIC,
                "brokers": [
                    {"brokerName": f"bench-{x}", "writeQueueNums": 8, "address": f"10.0.0.{i}:1"}
                    for i, x in enumerate("abcd", 1)
                ],
            }
        )
        now = table.now_ms()
        avoided = {"bench-b": FaultItem("bench-b", 30000, now + 600_000)}
        table.replace(PROFILES[args.profile], [route], avoided)
        assert client._stream is not None
        client._stream.synced.set()
        counter = [0]
        rng = random.Random()
        lock = threading.Lock()

        def bare() -> None:
            sel = strategy.select(route, counter[0], avoided, now, None, True)
            counter[0] = sel.next_counter

        def lock_pass() -> None:
            with lock:
                pass

        def send() -> None:
            sel = client.select(TOPIC)
            table.apply_report(sel.broker_name, 3, False)

        steps: dict[str, Callable[[], object]] = {
            "bare `strategy.select` (the bench's loop)": bare,
            "`DetourClient.select`, cached, kept answer": lambda: client.select(TOPIC),
            "`ClientCore.local_select`, kept answer": lambda: core.local_select(
                TOPIC, None, stream_connected=True
            ),
            "`LocalTable.select`, kept answer": lambda: table.select(TOPIC, None),
            "of which: a lock, acquire and release": lock_pass,
            "of which: the clock (`ServiceClock.now_ms`)": view.now_ms,
            "of which: the counter read": lambda: view.counter(TOPIC),
            "of which: the counter write": lambda: view.set_counter(TOPIC, counter[0]),
            "`LocalTable.select` deciding in full (an explicit `rng`)": lambda: table.select(
                TOPIC, None, None, rng
            ),
            "an empty call (loop + lambda)": lambda: None,
            "a select and a healthy report of its broker": send,
            "the report alone": lambda: table.apply_report("bench-a", 3, False),
        }
        epochs = itertools.count(-2, -1)  # a new epoch each call: a refresh each call
        steps["the memo's refresh after a change (`steady`)"] = lambda: view.memos.renew(
            route, view.config, view.faults, view.now_ms(), table.producer, next(epochs)
        )
        for fn in steps.values():
            cpu_ns(fn, min(args.calls, 2000))  # warm-up, discarded
        runs: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.runs):
            for name, fn in steps.items():
                runs[name].append(cpu_ns(fn, args.calls))
    finally:
        client.close(0.1)
    rows = ["| step | CPU ns/call (median) | runs |", "|---|---:|---|"]
    for name, values in runs.items():
        rows.append(
            f"| {name} | {statistics.median(values):,.0f} | "
            f"{', '.join(f'{v:,.0f}' for v in values)} |"
        )
    print("\n".join(rows))
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
