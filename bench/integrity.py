"""``python -m bench.integrity``: what state integrity costs, measured on real redis-servers.

Why: docs/reliability.md states how long a replica takes to put a lost table back and
what the report script costs at the table cap; those figures come from here.

* **report at the cap**: the report script's own execution time (Redis's SLOWLOG, µs)
  for a report of a new broker into a table of ``--cap`` items whose windows have all
  ended (it drops one to make room), against the baseline measured in the same run:
  the same report into an empty table. Median of ``--reports`` reports per run.
* **a merge after an empty restart**: one ``python -m service`` holding ``--windows``
  open windows (and a route); ``redis-server`` SIGKILLed and restarted empty on the same
  port; the time from the restarted server answering PING to every window being back
  in Redis, the merge scripts' execution time in Redis (longest call, and all calls
  summed), and the replica's CPU from the kill to its recovery.
* **an unneeded merge**: the same replica and windows, but Redis writes every command to
  its AOF before answering (``appendfsync always``) and comes back with all of it; the
  replica still sees another server (its mark is gone) and merges: the time until it is
  no longer degraded, the scripts' time in Redis, the replica's CPU, and how many entries
  it wrote back (none, when nothing was lost).

Each is run ``--runs`` times; the medians are reported. Everything listens on
127.0.0.1. Writes ``integrity.json`` and ``integrity.md`` under ``--out``.

    python -m bench.integrity [--runs 5] [--cap 10000] [--windows 10000] [--reports 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.procs import RedisServer, ServiceProcess, wait_until

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
PREFIX = "detour:{default}"


def _script_us(server: RedisServer, name_prefix: str = "EVALSHA") -> list[int]:
    with server.client() as c:
        return [int(e["duration"]) for e in c.slowlog_get(10_000)
                if str(e["command"]).startswith(name_prefix)
                or e["command"].startswith(name_prefix.encode())]


def _slowlog_all(server: RedisServer) -> None:
    with server.client() as c:
        c.config_set("slowlog-log-slower-than", 0)
        c.config_set("slowlog-max-len", 10_000)
        c.slowlog_reset()


def _batches(prefix: str, n: int, **fields: Any) -> list[dict[str, Any]]:
    return [{"reports": [{"brokerName": f"{prefix}{i}", **fields}
                         for i in range(start, min(start + 1000, n))]}
            for start in range(0, n, 1000)]


def _post_batch(c: httpx.Client, body: dict[str, Any]) -> None:
    """One batch, sent again while Detour sheds it (503 SYSTEM_BUSY on a busy machine:
    the same reports, applied once); anything else stops the run with the answer."""
    for _ in range(50):
        r = c.post("/report-latency:batch", json=body)
        if r.status_code != 503:
            break
        time.sleep(0.1)
    if r.status_code != 200:
        raise RuntimeError(f"batch refused: {r.status_code} {r.text[:300]}")


def report_at_cap(cap: int, reports: int) -> dict[str, float]:
    """Median µs of one new-broker report: into an empty table, and into a full one of
    ended windows."""
    out: dict[str, float] = {}
    server = RedisServer()
    env = {"DETOUR_MAX_BROKERS": str(cap), "DETOUR_REDIS_CALL_TIMEOUT_S": "5"}
    try:
        with ServiceProcess(redis_url=server.url, env=env) as svc, \
                httpx.Client(base_url=svc.url, timeout=30) as c:
            for label in ("empty", "full"):
                if label == "full":
                    for body in _batches("old", cap, latencyMs=1):
                        _post_batch(c, body)
                _slowlog_all(server)
                for n in range(reports):
                    r = c.post("/report-latency", json={"brokerName": f"{label}-new{n}",
                                                         "latencyMs": 1})
                    assert r.status_code == 200 and not r.json()["degraded"], r.text
                out[label] = statistics.median(_script_us(server))
    finally:
        server.stop()
    return out


def _cpu_ms(pid: int) -> float:
    """User + system CPU of a process so far (ms), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def _degraded(url: str) -> bool:
    return bool(httpx.get(url + "/readyz", timeout=5).json()["degraded"])


def merge(windows: int, lost: bool) -> dict[str, float]:
    """One replica holding ``windows`` open windows; Redis SIGKILLed and restarted, empty
    (``lost``) or from its AOF with everything. What the merge that follows costs."""
    server = RedisServer(persistent=not lost)
    restarted: RedisServer | None = None
    try:
        with ServiceProcess(redis_url=server.url,
                            env={"DETOUR_SYNC_INTERVAL_S": "0.2"}) as svc, \
                httpx.Client(base_url=svc.url, timeout=30) as c:
            c.put("/routes/t", json={"brokers": [{"brokerName": "a", "writeQueueNums": 2}]})
            for body in _batches("w", windows, latencyMs=0, isolation=True):
                _post_batch(c, body)
            wait_until(lambda: len(c.get("/fault-items").json()["items"]) == windows, 30,
                       "windows in the table")
            with server.client() as raw:
                version = int(raw.hget(f"{PREFIX}:meta", "version") or 0)
            cpu = _cpu_ms(svc.proc.pid)
            server.kill()
            restarted = RedisServer(port=server.port, data_dir=server.dir,
                                    persistent=not lost)
            started = time.monotonic()
            raw = restarted.client()
            _slowlog_all(restarted)
            if lost:
                wait_until(lambda: raw.hlen(f"{PREFIX}:faults") >= windows, 60,
                           "windows back", interval_s=0.005)
                elapsed_ms = (time.monotonic() - started) * 1000
            wait_until(lambda: not _degraded(svc.url), 60, "recovered", interval_s=0.005)
            if not lost:
                elapsed_ms = (time.monotonic() - started) * 1000
            scripts = [us for us in _script_us(restarted)]
            written = int(raw.hget(f"{PREFIX}:meta", "version") or 0) - (0 if lost else version)
            return {
                "ms": elapsed_ms,
                "largest_script_us": max(scripts, default=0),
                "scripts_us": sum(scripts),
                "replica_cpu_ms": _cpu_ms(svc.proc.pid) - cpu,
                "versions_written": written,
            }
    finally:
        server.stop()
        if restarted is not None:
            restarted.stop()


def markdown(result: dict[str, Any]) -> str:
    cap, rec, idle = result["report_at_cap"], result["merge"], result["unneeded"]
    w = f"{result['windows']:,}"
    return "\n".join([
        f"Medians of {result['runs']} runs.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| report script, new broker, empty table (baseline) | {cap['empty']:.0f} µs |",
        f"| report script, new broker, {result['cap']:,} ended windows | {cap['full']:.0f} µs "
        f"({cap['full'] / cap['empty']:.2f}x the baseline) |",
        f"| empty restart: all {w} windows back in Redis | "
        f"{rec['ms']:.0f} ms after the restarted server answers |",
        f"| that merge in Redis: longest call, all calls | "
        f"{rec['largest_script_us'] / 1000:.1f} ms, {rec['scripts_us'] / 1000:.0f} ms |",
        f"| that merge on the replica (CPU, kill to recovered) | {rec['replica_cpu_ms']:.0f} ms |",
        f"| restart that lost nothing ({w} windows): replica no longer degraded | "
        f"{idle['ms']:.0f} ms after the restarted server answers |",
        f"| that unneeded merge: entries written, scripts in Redis, replica CPU | "
        f"{idle['versions_written']:.0f}, {idle['scripts_us'] / 1000:.1f} ms, "
        f"{idle['replica_cpu_ms']:.0f} ms |",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.integrity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, choices=range(1, 21), metavar="1..20")
    p.add_argument("--cap", type=int, default=10_000)
    p.add_argument("--windows", type=int, default=10_000)
    p.add_argument("--reports", type=int, default=50)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    caps = [report_at_cap(args.cap, args.reports) for _ in range(args.runs)]
    merges = [merge(args.windows, lost=True) for _ in range(args.runs)]
    idle = [merge(args.windows, lost=False) for _ in range(args.runs)]
    result = {
        "runs": args.runs, "cap": args.cap, "windows": args.windows,
        "report_at_cap": {k: statistics.median(c[k] for c in caps) for k in caps[0]},
        "merge": {k: statistics.median(r[k] for r in merges) for k in merges[0]},
        "unneeded": {k: statistics.median(r[k] for r in idle) for k in idle[0]},
        "all": {"report_at_cap": caps, "merge": merges, "unneeded": idle},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "integrity.json").write_text(json.dumps(result, indent=2))
    (args.out / "integrity.md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
