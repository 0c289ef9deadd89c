"""The hot path's pieces in-process: writing /select's answer, and deciding a select.

    .venv/bin/python -m bench.answers --a /tmp/detour-main

1. The answer: the f-string JSON ``service/api/select.py`` writes against the standard
   library's C encoder on a dict, on the same decision, µs per answer (the two write
   the same bytes). Both in this process, alternating, medians of ``--repeats``.
2. The decision: ``service.selector.choose`` (route lookup, draws, the one decision,
   the counter) of tree A against tree B, each timed in a child process started from
   that tree, alternating, medians of ``--repeats``; CPU time (``time.process_time``),
   so another tenant's load does not count as ours.

Both print JSON and a Markdown line for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Timed in a child process from each tree: a 2-broker route, one broker avoided, a
#: select per loop like bench/throughput's; prints µs per select (CPU time).
_DECIDE = """
import time
from detour.model import BrokerRoute, Config, FaultItem, Route
from service.selector import choose
from detour.view import TableView
now = 1_764_000_000_000
view = TableView(lambda: now)
view.apply_config(Config(), 1)
route = Route.from_brokers("orders", [BrokerRoute("broker-a", 4), BrokerRoute("broker-b", 4)])
view.apply_route("orders", route, 1)
view.apply_fault("broker-b", FaultItem("broker-b", 600, now + 30000), 1)
n = {n}
for _ in range(1000):
    choose(view, "orders", None, None, None, None)
t = time.process_time()
for _ in range(n):
    choose(view, "orders", None, None, None, None)
print((time.process_time() - t) / n * 1e6)
"""


#: The same for the SDK's cached select (``LocalTable.select``: lock, the decision, the
#: SelectedQueue), on bench/client.py's route: 4 brokers x 8 queues, one avoided.
_SDK = """
import time
from detour.client.local import LocalTable
from detour.model import BrokerRoute, Config, FaultItem, Route
now = 1_764_000_000_000
table = LocalTable(lambda: now)
route = Route.from_brokers("orders", [BrokerRoute(f"broker-{i}", 8) for i in range(4)])
table.replace(Config(), [route], {"broker-1": FaultItem("broker-1", 600, now + 30000)})
n = {n}
for _ in range(1000):
    table.select("orders", None)
t = time.process_time()
for _ in range(n):
    table.select("orders", None)
print((time.process_time() - t) / n * 1e6)
"""


def _fstring(topic: str, broker: str, qid: int, address: str | None) -> str:
    """service/api/select.py's answer, written by hand as it is there."""
    address_json = f'"{address}"' if address else "null"
    avoided = ",".join(f'"{b}"' for b in ("broker-b",))
    none: tuple[str, ...] = ()
    unenforced = ",".join(f'"{b}"' for b in none)
    ordered = "null"
    return (
        f'{{"topic":"{topic}","brokerName":"{broker}",'
        f'"queueId":{qid},"address":{address_json},'
        f'"decision":"available","avoidedBrokers":[{avoided}],'
        f'"degraded":{"true" if False else "false"},'
        f'"panic":{"true" if False else "false"},'
        f'"dryRun":{"true" if False else "false"},'
        f'"unenforcedBrokers":[{unenforced}],"ordered":{ordered},'
        f'"probe":{"true" if False else "false"}}}'
    )


_encode = json.JSONEncoder(separators=(",", ":")).encode


def _encoder(topic: str, broker: str, qid: int, address: str | None) -> str:
    """The same answer through the standard library's encoder (the alternative)."""
    return _encode(
        {
            "topic": topic,
            "brokerName": broker,
            "queueId": qid,
            "address": address or None,
            "decision": "available",
            "avoidedBrokers": ("broker-b",),
            "degraded": False,
            "panic": False,
            "dryRun": False,
            "unenforcedBrokers": (),
            "ordered": None,
            "probe": False,
        }
    )


def _report_fstring(broker: str, latency: int, duration: int, end: int) -> str:
    """service/api/reports.py's answer, written by hand as it is there."""
    return (
        f'{{"brokerName":"{broker}","latencyMs":{latency},'
        f'"notAvailableDurationMs":{duration},'
        f'"availableAt":{end},"degraded":{"true" if False else "false"}}}'
    )


def _report_encoder(broker: str, latency: int, duration: int, end: int) -> str:
    return _encode(
        {
            "brokerName": broker,
            "latencyMs": latency,
            "notAvailableDurationMs": duration,
            "availableAt": end,
            "degraded": False,
        }
    )


_SELECT_ARGS = ("orders", "broker-a", 3, "10.0.0.5:10911")
_REPORT_ARGS = ("broker-a", 27, 0, 1_764_000_000_000)


def _per_call_us(fn: object, n: int, args: tuple[object, ...] = _SELECT_ARGS) -> float:
    t = time.process_time()
    for _ in range(n):
        fn(*args)  # type: ignore[operator]
    return (time.process_time() - t) / n * 1e6


def answers(repeats: int, n: int, report: bool = False) -> dict[str, float]:
    fstring, encoder, args = (
        (_report_fstring, _report_encoder, _REPORT_ARGS)
        if report
        else (_fstring, _encoder, _SELECT_ARGS)
    )
    assert fstring(*args) == encoder(*args), "the two forms must write the same bytes"
    f_runs: list[float] = []
    e_runs: list[float] = []
    for i in range(repeats):
        for name in ("f", "e") if i % 2 == 0 else ("e", "f"):
            runs = f_runs if name == "f" else e_runs
            runs.append(_per_call_us(fstring if name == "f" else encoder, n, args))
    f_us, e_us = statistics.median(f_runs), statistics.median(e_runs)
    return {"fstring_us": f_us, "encoder_us": e_us, "extra_us": e_us - f_us}


def decisions(
    tree_a: Path, tree_b: Path, repeats: int, n: int, code: str = _DECIDE
) -> dict[str, float]:
    code = code.replace("{n}", str(n))
    runs: dict[str, list[float]] = {"a": [], "b": []}
    for i in range(repeats):
        for side in ("a", "b") if i % 2 == 0 else ("b", "a"):
            tree = tree_a if side == "a" else tree_b
            out = subprocess.run(
                [sys.executable, "-c", code], cwd=tree, capture_output=True, text=True,
                timeout=120, check=True,
            )  # fmt: skip
            runs[side].append(float(out.stdout.strip()))
    a_us, b_us = statistics.median(runs["a"]), statistics.median(runs["b"])
    return {"a_us": a_us, "b_us": b_us, "ratio_b_over_a": b_us / a_us}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="baseline source tree")
    parser.add_argument("--b", type=Path, default=ROOT, help="candidate source tree")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("-n", type=int, default=200_000, help="calls per timing")
    args = parser.parse_args(argv)
    if not 1 <= args.repeats <= 50 or not 1_000 <= args.n <= 5_000_000:
        parser.error("repeats 1..50, n 1000..5000000")
    ans = answers(args.repeats, args.n)
    rep = answers(args.repeats, args.n, report=True)
    dec = decisions(args.a, args.b, args.repeats, args.n // 4)
    sdk = decisions(args.a, args.b, args.repeats, args.n // 4, _SDK)
    print(json.dumps({"answer": ans, "report_answer": rep, "decision": dec, "sdk": sdk}))
    for what, a in (("/select answer", ans), ("/report-latency answer", rep)):
        print(
            f"| {what} | {a['fstring_us']:.2f} | {a['encoder_us']:.2f} | "
            f"{a['extra_us']:+.2f} µs |"
        )
    for what, d in (("selector.choose", dec), ("LocalTable.select (SDK, cached)", sdk)):
        print(
            f"| {what} | {d['a_us']:.2f} | {d['b_us']:.2f} | "
            f"{d['b_us'] - d['a_us']:+.2f} µs ({d['ratio_b_over_a']:.2f}x) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
