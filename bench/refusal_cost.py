"""Server CPU per response while shedding nearly everything, for code versions side by side.

``python -m bench.refusal_cost DIR [DIR ...]``: each DIR is a checkout of Detour (this one,
an exported older commit); for each, rounds alternating, a fresh ``python -m service``
(memory store) with ``DETOUR_MAX_IN_FLIGHT=8`` and a turn budget so small that at most
one request starts per loop turn while shedding, loaded by wrk (64 connections, closed
loop, one request at a time each, as the overload generator's connections) on
``/select`` for 5 s; the server's CPU (user + system) over the responses. About 98% of
the responses are 503 refusals, so the figure is the cost of a refusal. CPU per
response, not req/s: it carries over from a busy machine.

``--floor`` adds the refusal floor (``bench/refusal_floor.py``: refuses everything, does
nothing else) to each round, under the same load: the least a refusal can cost on this
stack, so the gap above it is what Detour's own refusal path costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence

_RUN = r"""
import json
from pathlib import Path
import httpx
from bench.loadgen import proc_cpu_s, process_tree, run_wrk, write_script
from tests.procs import ServiceProcess
env = {"DETOUR_TURN_BUDGET_MS": "0.000001", "DETOUR_MAX_IN_FLIGHT": "8"}
with ServiceProcess(env=env) as svc:
    route = {"brokers": [{"brokerName": "a", "writeQueueNums": 4}]}
    httpx.put(svc.url + "/routes/orders", json=route, timeout=5).raise_for_status()
    script = write_script(Path(WORK) / "select.lua", "/select", [{"topic": "orders"}])
    run_wrk(svc.url, script, connections=64, duration_s=1)
    pids = process_tree(svc.proc.pid)
    before = sum(proc_cpu_s(p) for p in pids)
    r = run_wrk(svc.url, script, connections=64, duration_s=5)
    cpu = sum(proc_cpu_s(p) for p in pids) - before
    print("RESULT", json.dumps({"requests": r.requests, "refused": r.errors.get("status", 0),
                                "cpu_s": cpu}))
"""

#: The same measurement on the refusal floor (bench/refusal_floor.py): a server that
#: refuses everything and does nothing else, on the same machinery. What is left of
#: Detour's figure above it is Detour's own per-refusal work.
_FLOOR = r"""
import json
from pathlib import Path
from bench.loadgen import proc_cpu_s, run_wrk, write_script
from bench.refusal_floor import running
from tests.procs import free_port
port = free_port()
with running(port) as proc:
    url = f"http://127.0.0.1:{port}"
    script = write_script(Path(WORK) / "select.lua", "/select", [{"topic": "orders"}])
    run_wrk(url, script, connections=64, duration_s=1)
    before = proc_cpu_s(proc.pid)
    r = run_wrk(url, script, connections=64, duration_s=5)
    cpu = proc_cpu_s(proc.pid) - before
    print("RESULT", json.dumps({"requests": r.requests, "refused": r.errors.get("status", 0),
                                "cpu_s": cpu}))
"""
FLOOR = "refusal floor"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.refusal_cost", description=__doc__)
    p.add_argument("dirs", nargs="+", help="Detour checkouts to compare")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", default="/tmp", help="where wrk's script is written")
    p.add_argument("--floor", action="store_true",
                   help="also measure the refusal floor (bench/refusal_floor.py) each round")
    args = p.parse_args(argv)
    names = [*args.dirs, FLOOR] if args.floor else list(args.dirs)
    runs: dict[str, list[dict[str, float]]] = {d: [] for d in names}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for r in range(args.rounds):
        for d in names if r % 2 == 0 else names[::-1]:
            code = f"WORK = {args.work!r}\n" + (_FLOOR if d == FLOOR else _RUN)
            cwd = here if d == FLOOR else d
            out = subprocess.run(
                [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                env={**os.environ, "PYTHONPATH": cwd}, timeout=180,
            )  # fmt: skip
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{d}: {out.stderr[-1000:]}")
            x = json.loads(line[len("RESULT ") :])
            x["us_per_response"] = x["cpu_s"] / x["requests"] * 1e6
            runs[d].append(x)
            print(f"{d} round {r + 1}: {x['us_per_response']:.1f} µs/response, "
                  f"{x['refused'] / x['requests']:.1%} refused, load {os.getloadavg()[0]:.1f}",
                  file=sys.stderr)  # fmt: skip
    print("| code | server CPU µs per response (rounds) | median | refused |")
    print("|---|---|---:|---:|")
    for d, xs in runs.items():
        us = [x["us_per_response"] for x in xs]
        share = statistics.median(x["refused"] / x["requests"] for x in xs)
        print(f"| `{d}` | {', '.join(f'{u:.1f}' for u in us)} | **{statistics.median(us):.1f}** "
              f"| {share:.1%} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
