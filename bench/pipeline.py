"""``python -m bench.pipeline``: the Spark producing job with Detour and without, same faults.

Why this benchmark: Detour's value is what a fleet of producers does *not* pay
when a broker dies or hangs. Each arm runs ``pipeline.produce`` on Spark
``local[*]`` over the same generated dataset against a fresh fleet of 4
redis-server brokers, with the same fault schedule keyed to progress (messages
on the brokers, so a slow arm gets its faults at the same point of its work):

    kill  broker-b at 25 % of the records, restarted 8 s later (same port, AOF)
    stop  broker-c at 50 % of the records, SIGCONT 5 s later

Arms, in one invocation so they share the machine's state:

    detour-cached   the default: selects decided in-process from the event stream
    detour-remote   every select a POST /select to Detour
    round-robin     the same cached client with avoidance off
                    (PATCH /config {"sendLatencyFaultEnable": false}): RocketMQ
                    with sendLatencyFaultEnable=false, the retry loop only

Recorded per arm: records/s over the sending window (first send to last
completion), failed attempts (sends that raised: refused or timed out), p99
of a record's whole send (every attempt), failed records, records lost
(``pipeline.verify`` over every stream) and duplicates. Writes
``pipeline.json`` and ``pipeline.md`` under ``--out``; ``--append FILE`` adds the
table as a "## Spark pipeline" section at the end of FILE (re-read right
before, appended only).

    python -m bench.pipeline --records 20000 --append docs/BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from pipeline import spark_session
from pipeline.brokers import FaultEvent, Fleet
from pipeline.generate import generate
from pipeline.produce import ProduceOptions, produce, read_input
from pipeline.verify import brokers_from_detour, verify
from tests.procs import ROOT, RedisServer, ServiceProcess

ARMS: dict[str, tuple[str, bool]] = {
    # name: (client mode, avoidance on)
    "detour-cached": ("cached", True),
    "detour-remote": ("remote", True),
    "round-robin": ("cached", False),
}


@dataclass
class ArmResult:
    arm: str
    mode: str
    avoidance: bool
    records: int
    records_per_s: float
    send_seconds: float
    failed_attempts: int
    failed_on_killed: int
    failed_on_stopped: int
    failed_records: int
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    lost: int
    duplicates: int
    faults: list[dict[str, Any]]
    client: dict[str, int]


def schedule(records: int) -> list[str]:
    return [f"kill:broker-b@{records // 4}r+8", f"stop:broker-c@{records // 2}r+5"]


def run_arm(spark: Any, detour: str, arm: str, src: str, records: int, work: Path) -> ArmResult:
    mode, avoidance = ARMS[arm]
    topic = f"bench-{arm}"
    with httpx.Client(base_url=detour, timeout=5) as c:
        c.patch("/config", json={"sendLatencyFaultEnable": avoidance}).raise_for_status()
    with Fleet(4, topic, 4) as fleet:
        fleet.register(detour)
        with httpx.Client(base_url=detour, timeout=5) as c:
            for name in fleet.brokers:  # windows from the previous arm (same broker names)
                c.delete(f"/fault-items/{name}")
        runner = fleet.faults(schedule(records)).start()
        try:
            summary = produce(spark, read_input(spark, src),
                              ProduceOptions(detour, topic, mode=mode), str(work / arm))
            runner.wait(30)
        finally:
            runner.stop()  # SIGCONT / restart still owed fire now
        for b in fleet.brokers.values():
            if b.state == "down":
                b.restart()
        v = verify(spark, read_input(spark, src), brokers_from_detour(detour, topic), topic)
        events: list[FaultEvent] = runner.events
    return ArmResult(
        arm=arm, mode=mode, avoidance=avoidance, records=summary.records,
        records_per_s=round(summary.records_per_s, 1), send_seconds=round(summary.send_seconds, 2),
        failed_attempts=summary.failed_attempts,
        failed_on_killed=summary.failed_per_broker.get("broker-b", 0),
        failed_on_stopped=summary.failed_per_broker.get("broker-c", 0),
        failed_records=summary.failed, p50_ms=round(summary.p50_ms, 2),
        p99_ms=round(summary.p99_ms, 2), p999_ms=round(summary.p999_ms, 2),
        max_ms=round(summary.max_ms, 1), lost=v.missing, duplicates=v.extra_copies,
        faults=[asdict(e) for e in events], client=summary.client,
    )


def markdown(results: Sequence[ArmResult], records: int, command: str, when: str) -> str:
    lines = [
        "## Spark pipeline",
        "",
        f"`pipeline/produce.py` on Spark `local[*]` (2 cores), {records:,} records, 4 partitions "
        "(one Detour client each), 4 redis-server brokers x 4 queues, Detour on Redis. Same "
        "fault schedule in every arm, keyed to progress: broker-b SIGKILLed at 25 % of the "
        "records and restarted 8 s later; broker-c SIGSTOPped at 50 % for 5 s. Broker socket "
        "timeout 200 ms, 3 attempts per record. `round-robin` is the same client with "
        "`PATCH /config {\"sendLatencyFaultEnable\": false}`.",
        "",
        "| arm | records/s | failed attempts (killed / stopped broker) | failed records | "
        "p50 send ms | p99 send ms | p99.9 send ms | max send ms | lost | duplicates |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.arm} | {r.records_per_s:,.0f} | {r.failed_attempts} ({r.failed_on_killed} / "
            f"{r.failed_on_stopped}) | {r.failed_records} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | "
            f"{r.p999_ms:.2f} | {r.max_ms:.0f} | {r.lost} | {r.duplicates} |"
        )
    lines += [
        "",
        "A record's send time covers every attempt (select, XADD, report). Duplicates are "
        "sends that timed out on the stopped broker and landed when it woke (at-least-once); "
        "lost counts ids on no broker after the run (`pipeline/verify.py`).",
        "",
        f"Measured {when} on the project machine ({platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}), shared with other work at the time. Command:",
        "",
        "```sh",
        command,
        "```",
        "",
    ]
    return "\n".join(lines)


def append_section(path: Path, section: str) -> None:
    """Append ``section`` at the end of ``path``, re-reading it right before (append only)."""
    current = path.read_text() if path.exists() else ""
    sep = "" if not current or current.endswith("\n\n") else ("\n" if current.endswith("\n")
                                                              else "\n\n")
    with open(path, "a") as f:
        f.write(sep + section)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=20_000)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--append", type=Path, default=None, help="append the section to this file")
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        p.error(f"unknown arms: {sorted(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.pipeline " + " ".join(argv if argv is not None else sys.argv[1:])
    store = RedisServer()
    svc = None
    spark = None
    try:
        svc = ServiceProcess(redis_url=store.url, log_path=args.out / "pipeline-detour.log")
        spark = spark_session("detour-bench-pipeline", "local[*]", {
            "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": "2",
        })
        spark.sparkContext.setLogLevel("ERROR")
        with tempfile.TemporaryDirectory(prefix="detour-bench-pipeline-") as tmp:
            work = Path(tmp)
            src = str(work / "in")
            generate(spark, args.records, src, "parquet", partitions=4)
            results = []
            for arm in arms:
                r = run_arm(spark, svc.url, arm, src, args.records, work)
                print(json.dumps(asdict(r)), flush=True)
                results.append(r)
    finally:
        if spark is not None:
            spark.stop()
        if svc is not None:
            svc.stop()
        store.stop()
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    section = markdown(results, args.records, command.strip(), when)
    (args.out / "pipeline.json").write_text(json.dumps(
        {"records": args.records, "when": when, "command": command,
         "results": [asdict(r) for r in results]}, indent=2))
    (args.out / "pipeline.md").write_text(section)
    print(section)
    if args.append is not None:
        append_section(args.append if args.append.is_absolute() else ROOT / args.append,
                       section)
        print(f"appended to {args.append}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
