"""``python -m bench.redis_load``: Redis commands per fast report, per-report writes against
the flushes of docs/semantics.md, on one real ``redis-server``.

Why: the issue's target is at most 0.05 Redis commands per report that opens no window
(fleet scale: thousands of sidecars each reporting every send into one hash slot). A
command run inside a script counts like any other, so the figure is Redis's own
``INFO stats`` ``total_commands_processed`` delta over the run, divided by the reports;
``INFO commandstats`` gives the split (``EVALSHA`` calls, the commands they ran).

One run per mode: a fresh ``python -m service`` (1 worker, Redis store) on a fresh Redis;
each broker gets one first report (it creates the item: sent in both modes, once per
broker per replica, not counted), then ``--seconds`` of
fast reports (5-200 ms, no window) from ``--concurrency`` HTTP clients, single reports or
batches of ``--batch``. Everything the replica sends in that time counts: its polls, its
flushes, the bench's own two ``INFO`` calls.

* ``per-report``: ``DETOUR_REPORT_FLUSH_MS=0``, every report one ``report.lua`` call (main's
  path before this change);
* ``flush``: the default 1,000 ms flush (reports that change no window kept on the
  replica, one summary per broker per flush).

Modes alternate, ``--runs`` rounds; medians reported. 127.0.0.1 only. Writes
``redis_load.json`` and ``redis_load.md`` under ``--out``.

    python -m bench.redis_load [--runs 3] [--seconds 5] [--brokers 8] [--batch 1] [--rate 0]

The ratio is a fixed cost per flush interval over the reports of that interval, so it
falls as the send rate rises: ``--rate 1000 --batch 10`` stands for one sidecar's 1,000
sends a second (the issue's fleet figure), which a loaded 2-core machine cannot drive as
single HTTP requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.procs import RedisServer, ServiceProcess

OUT = Path("/tmp/detour-bench")
MODES = {"per-report": "0", "flush": "1000"}


def _commands(server: RedisServer) -> tuple[int, dict[str, int]]:
    with server.client() as c:
        total = int(c.info("stats")["total_commands_processed"])
        stats = {
            k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in c.info("commandstats").items()
        }
    return total, stats


def _names(brokers: int) -> list[str]:
    return [f"broker-{i}" for i in range(brokers)]


def _seed(url: str, brokers: int) -> None:
    """Each broker's first report: it creates the item (sent, not counted in the run)."""
    for name in _names(brokers):
        httpx.post(
            f"{url}/report-latency", json={"brokerName": name, "latencyMs": 20}, timeout=10
        ).raise_for_status()


async def _drive(
    url: str, brokers: int, seconds: float, concurrency: int, batch: int, rate: float = 0
) -> int:
    """Fast reports for ``seconds`` (at most ``rate`` a second over all clients, 0 = as
    fast as they are answered); returns how many were answered 200."""
    names = _names(brokers)
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        end = time.monotonic() + seconds

        async def worker(seed: int) -> int:
            rnd, n = random.Random(seed), 0
            period = concurrency * batch / rate if rate else 0.0
            due = time.monotonic() + period * seed / concurrency
            while time.monotonic() < end:
                if period:
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                    due += period
                reports = [
                    {"brokerName": rnd.choice(names), "latencyMs": rnd.randint(5, 200)}
                    for _ in range(batch)
                ]
                if batch == 1:
                    r = await client.post("/report-latency", json=reports[0])
                else:
                    r = await client.post("/report-latency:batch", json={"reports": reports})
                if r.status_code == 503:  # shed under load: not applied, not counted
                    await asyncio.sleep(0.01)
                    continue
                r.raise_for_status()
                n += batch
            return n

        done += sum(await asyncio.gather(*(worker(i) for i in range(concurrency))))
    return done


def one_run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    server = RedisServer()
    try:
        env = {"DETOUR_REPORT_FLUSH_MS": MODES[mode]}
        with ServiceProcess(server.url, env=env) as svc:
            _seed(svc.url, args.brokers)
            total0, stats0 = _commands(server)
            reports = asyncio.run(
                _drive(svc.url, args.brokers, args.seconds, args.concurrency, args.batch, args.rate)
            )
            # The last interval's flush: wait one flush interval so it is counted.
            time.sleep(1.2)
            total1, stats1 = _commands(server)
    finally:
        server.stop()
    calls = {k: v - stats0.get(k, 0) for k, v in stats1.items() if v - stats0.get(k, 0)}
    commands = total1 - total0
    return {
        "mode": mode,
        "reports": reports,
        "commands": commands,
        "per_report": commands / reports,
        "per_second": commands / args.seconds,
        "evalsha": calls.get("evalsha", 0),
        "calls": calls,
    }


def markdown(result: dict[str, Any]) -> str:
    rows = [
        "| mode | reports (median) | Redis commands | commands per s | commands per report "
        "| EVALSHA per report |",
        "|---|---|---|---|---|---|",
    ]
    for mode, m in result["medians"].items():
        rows.append(
            f"| {mode} | {m['reports']:.0f} | {m['commands']:.0f} | {m['per_second']:.1f} "
            f"| {m['per_report']:.4f} "
            f"| {m['evalsha_per_report']:.4f} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.redis_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--runs", type=int, default=3, choices=range(1, 21), metavar="1..20")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--brokers", type=int, default=8, choices=range(1, 1001), metavar="1..1000")
    p.add_argument("--concurrency", type=int, default=16, choices=range(1, 257), metavar="1..256")
    p.add_argument("--batch", type=int, default=1, choices=range(1, 1001), metavar="1..1000")
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="reports a second over all clients (0: as fast as answered)",
    )
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if not 0 < args.seconds <= 600:
        p.error("--seconds must be in (0, 600]")
    if not 0 <= args.rate <= 1_000_000:
        p.error("--rate must be in [0, 1000000]")
    runs: list[dict[str, Any]] = []
    for _ in range(args.runs):
        for mode in MODES:
            runs.append(one_run(mode, args))
    medians = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        medians[mode] = {
            "reports": statistics.median(r["reports"] for r in mine),
            "commands": statistics.median(r["commands"] for r in mine),
            "per_report": statistics.median(r["per_report"] for r in mine),
            "evalsha_per_report": statistics.median(r["evalsha"] / r["reports"] for r in mine),
            "per_second": statistics.median(r["per_second"] for r in mine),
        }
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "medians": medians, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "redis_load.json").write_text(json.dumps(result, indent=2))
    (args.out / "redis_load.md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
