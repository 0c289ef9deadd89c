"""``python -m bench.sidecar_metrics``: what scraping a sidecar's metrics listener costs, per pod.

Why: the sidecar shape puts ``GET /metrics`` on the pod IP (``DETOUR_METRICS_HOST``) so
Prometheus sees every sidecar (docs/deploy.md, "Sidecar shape"); a fleet pays that per
producer pod, so the figure should be measured. One ``python -m service`` as the sidecar
runs it (one worker, loopback, on a redis-server), with a route of ``--brokers`` brokers,
a select per broker, one report each and one failure, so every per-broker series exists:

* **memory**: resident memory (VmRSS) of the same process shape with and without the
  listener, each idle after the same requests (median of ``--samples`` readings a second
  apart);
* **one scrape**: its size (bytes, samples: the series Prometheus stores per pod) and,
  over ``--scrapes`` scrapes through the listener with a token, the sidecar's CPU time
  per scrape (user + system from /proc, ``DETOUR_METRICS_CACHE_S=0`` so each scrape
  renders) and its wall time;
* **per pod at a 15 s interval** (the PodMonitor's): CPU share of a core, bytes/s sent,
  samples/s Prometheus ingests.

Everything listens on 127.0.0.1. Writes ``sidecar-metrics.json`` and ``.md`` under ``--out``.

    python -m bench.sidecar_metrics [--brokers 4] [--scrapes 200] [--samples 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.procs import RedisServer, ServiceProcess, free_port, write_tokens

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
TOPIC = "orders"
TOKEN = "bench-scrape-token"
#: The PodMonitor's scrape interval (deploy/overlays/sidecar/podmonitor.yaml).
INTERVAL_S = 15.0
TICKS = os.sysconf("SC_CLK_TCK")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise KeyError("VmRSS")


def _cpu_s(pid: int) -> float:
    """User + system CPU time of a process, seconds (/proc/<pid>/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _traffic(url: str, brokers: int) -> None:
    """A route, a select and a report per broker, and one failure: every series exists."""
    names = [f"broker-{i}" for i in range(brokers)]
    with httpx.Client(base_url=url, timeout=5) as http:
        http.put(f"/routes/{TOPIC}", json={"brokers": [
            {"brokerName": b, "writeQueueNums": 4} for b in names]}).raise_for_status()
        for b in names:
            http.post("/select", json={"topic": TOPIC}).raise_for_status()
            http.post("/report-latency", json={"brokerName": b, "latencyMs": 12}
                      ).raise_for_status()
        http.post("/report-latency", json={"brokerName": names[0], "latencyMs": 0,
                                           "isolation": True}).raise_for_status()


def _idle_rss_mib(pid: int, samples: int) -> float:
    readings = []
    for _ in range(samples):
        time.sleep(1.0)  # spacing the readings, not synchronisation
        readings.append(_rss_kib(pid))
    return round(statistics.median(readings) / 1024, 1)


def run(brokers: int, scrapes: int, samples: int, workdir: Path) -> dict[str, Any]:
    tokens = write_tokens(workdir / "metrics-tokens.json",
                          {"prometheus": (TOKEN, "metrics", "*")})
    redis = RedisServer()
    try:
        with ServiceProcess(redis_url=redis.url) as plain:
            _traffic(plain.url, brokers)
            rss_without = _idle_rss_mib(plain.proc.pid, samples)
        port = free_port()
        env = {"DETOUR_METRICS_HOST": "127.0.0.1", "DETOUR_METRICS_PORT": str(port),
               "DETOUR_METRICS_TOKENS_FILE": str(tokens), "DETOUR_METRICS_CACHE_S": "0"}
        with ServiceProcess(redis_url=redis.url, env=env) as svc:
            _traffic(svc.url, brokers)
            headers = {"Authorization": f"Bearer {TOKEN}"}
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers,
                              timeout=10) as http:
                first = http.get("/metrics")
                first.raise_for_status()
                rss_with = _idle_rss_mib(svc.proc.pid, samples)
                walls = []
                cpu0 = _cpu_s(svc.proc.pid)
                for _ in range(scrapes):
                    t0 = time.perf_counter()
                    http.get("/metrics").raise_for_status()
                    walls.append((time.perf_counter() - t0) * 1000)
                cpu_ms = (_cpu_s(svc.proc.pid) - cpu0) * 1000 / scrapes
                body = http.get("/metrics").content
    finally:
        redis.stop()
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    walls.sort()
    return {
        "brokers": brokers,
        "scrapes": scrapes,
        "rss_mib": {"without_listener": rss_without, "with_listener": rss_with,
                    "added": round(rss_with - rss_without, 1)},
        "scrape": {"bytes": len(body), "series": series,
                   "cpu_ms": round(cpu_ms, 2),
                   "wall_ms_median": round(statistics.median(walls), 2),
                   "wall_ms_p95": round(walls[int(0.95 * (len(walls) - 1))], 2)},
        "per_pod_at_15s": {"cpu_percent_of_a_core": round(100 * cpu_ms / 1000 / INTERVAL_S, 3),
                           "bytes_per_s": round(len(body) / INTERVAL_S),
                           "samples_per_s": round(series / INTERVAL_S, 1)},
        "machine": {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2),
                    "python": sys.version.split()[0]},
    }


def markdown(rs: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| brokers | series per pod | bytes per scrape | CPU per scrape (wall median, p95) "
        "| at 15 s: CPU, bytes/s, samples/s | resident memory without / with the listener |",
        "|---|---|---|---|---|---|",
    ]
    for r in rs:
        s, p, m = r["scrape"], r["per_pod_at_15s"], r["rss_mib"]
        lines.append(
            f"| {r['brokers']} | {s['series']:,} | {s['bytes']:,} | {s['cpu_ms']} ms "
            f"({s['wall_ms_median']} ms, {s['wall_ms_p95']} ms) | "
            f"{p['cpu_percent_of_a_core']} % of a core, {p['bytes_per_s']:,} B/s, "
            f"{p['samples_per_s']} | {m['without_listener']} / {m['with_listener']} MiB "
            f"({m['added']:+} MiB) |")
    mach = rs[-1]["machine"]
    lines += ["", f"({mach['cpus']} CPUs, load {mach['load_1m']} at the end, "
                  f"Python {mach['python']}; {rs[-1]['scrapes']} scrapes each)"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sidecar_metrics", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--brokers", type=int, action="append", default=None,
                   help="brokers in the route (repeatable; default 4 and 100)")
    p.add_argument("--scrapes", type=int, default=200, help="scrapes timed")
    p.add_argument("--samples", type=int, default=5, help="memory readings per process")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run(b, args.scrapes, args.samples, args.out) for b in (args.brokers or [4, 100])]
    (args.out / "sidecar-metrics.json").write_text(json.dumps(results, indent=2))
    (args.out / "sidecar-metrics.md").write_text(markdown(results) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
