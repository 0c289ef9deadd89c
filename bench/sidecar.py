"""``python -m bench.sidecar``: what Detour as a producer's sidecar costs in memory and probes.

Why: the sidecar's memory request and limit, and the probe the kubelet runs in it,
are set in deploy/overlays/sidecar/producer.yaml and deploy/spark/executor-pod-template.yaml;
they should come from a measurement, not a guess. One ``python -m service`` (one
worker, loopback, on a redis-server, as in the manifests) is measured:

* **idle**: resident memory (VmRSS) once its table is synced;
* **producing**: the peak (VmHWM) while ``--clients`` SDK clients in cached mode,
  one per thread like a Spark executor's partitions, send and report for
  ``--seconds`` (their stream, their report batches);
* **journal full**: the peak after Redis is stopped (SIGSTOP) and
  ``DETOUR_JOURNAL_MAX`` reports are sent to it in batches: the most a sidecar holds
  when Redis is away longer than it takes a producer to send that many;
* **probes**: each candidate probe command run ``--probes`` times against it:
  wall time, CPU time (user + system, from the children's rusage) and the peak
  resident memory of one run (``/usr/bin/time``, Debian package ``time``).

Everything listens on 127.0.0.1. Writes ``sidecar.json`` and ``sidecar.md`` under
``--out``.

    python -m bench.sidecar [--seconds 20] [--clients 4] [--probes 200]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.procs import RedisServer, ServiceProcess

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
TOPIC = "orders"
ROUTE = {"brokers": [{"brokerName": f"broker-{c}", "writeQueueNums": 4} for c in "abcd"]}

#: The probes compared. {port} is Detour's; the manifests' use 8080.
PROBES = {
    # What the manifests ran before: a Python interpreter and urllib, per probe.
    "python urllib": [sys.executable, "-c",
                      "import urllib.request as u; "
                      "u.urlopen('http://127.0.0.1:{port}/readyz', timeout=1)"],
    # What they run now: bash's /dev/tcp, one HTTP/1.0 request, the status line read.
    "bash /dev/tcp": ["bash", "-c",
                      'exec 3<>/dev/tcp/127.0.0.1/{port} && '
                      'printf "GET /readyz HTTP/1.0\\r\\n\\r\\n" >&3 && '
                      'IFS= read -r -t 1 status <&3 && [[ $status == "HTTP/1."?" 200 "* ]]'],
}


def _status_kib(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of a process, KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _mib(kib: int) -> float:
    return round(kib / 1024, 1)


def _fast_send(queue: object, payload: int) -> None:
    """A broker send that succeeds at once (the broker side is not what is measured); it
    yields the GIL, as a send on the network would, so the client threads interleave."""
    time.sleep(0)


def _slow_send(queue: object, payload: int) -> None:
    """One send in 500: slow enough to open an avoidance window."""
    time.sleep(0.6)


def producing(url: str, clients: int, seconds: float) -> dict[str, Any]:
    """``clients`` cached-mode SDK clients sending for ``seconds``; sends done."""
    from detour.client import DetourClient

    stop = time.monotonic() + seconds
    sent = [0] * clients

    def run(i: int) -> None:
        with DetourClient(url, mode="cached", producer=f"bench/p{i}") as client:
            client.wait_ready(10)
            n = 0
            while time.monotonic() < stop:
                client.send(TOPIC, n, _slow_send if n % 500 == 0 else _fast_send)
                n += 1
            sent[i] = n

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    return {"clients": clients, "seconds": seconds, "sends": sum(sent)}


def fill_journal(url: str, redis: RedisServer, reports: int) -> int:
    """Stop Redis and send ``reports`` reports: each lands in the journal. Returns how many
    the sidecar answered as degraded."""
    os.kill(redis.proc.pid, signal.SIGSTOP)
    degraded = 0
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            for start in range(0, reports, 1000):
                batch = [{"brokerName": f"broker-{'abcd'[i % 4]}", "latencyMs": i % 700,
                          "producer": "bench/journal"}
                         for i in range(start, min(reports, start + 1000))]
                r = c.post("/report-latency:batch", json={"reports": batch})
                r.raise_for_status()
                degraded += sum(1 for x in r.json()["results"] if x.get("degraded"))
    finally:
        os.kill(redis.proc.pid, signal.SIGCONT)
    return degraded


def probes(port: int, runs: int) -> dict[str, dict[str, float]]:
    """Each probe ``runs`` times: wall and CPU ms per run, peak resident memory of a run.

    CPU is the children's rusage over the runs. The peak is ``/usr/bin/time``'s (``%M``):
    a child's own ``ru_maxrss`` would count this large parent's pages it was forked with.
    """
    time_bin = shutil.which("time") or "/usr/bin/time"
    out = {}
    for name, template in PROBES.items():
        argv = [a.replace("{port}", str(port)) for a in template]
        walls = []
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        for _ in range(runs):
            t0 = time.perf_counter()
            rc = subprocess.run(argv, capture_output=True, timeout=10).returncode
            walls.append((time.perf_counter() - t0) * 1000)
            if rc != 0:
                raise RuntimeError(f"probe {name!r} failed against a ready Detour: rc {rc}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        peaks = []
        for _ in range(5):
            timed = subprocess.run([time_bin, "-f", "%M", *argv], capture_output=True,
                                   text=True, timeout=10, check=True)
            peaks.append(int(timed.stderr.strip().splitlines()[-1]))
        out[name] = {
            "runs": runs,
            "wall_ms_median": round(statistics.median(walls), 1),
            "wall_ms_p95": round(sorted(walls)[int(0.95 * (len(walls) - 1))], 1),
            "cpu_ms_per_run": round(cpu * 1000 / runs, 2),
            "peak_rss_mib": _mib(max(peaks)),
        }
    return out


def run(seconds: float, clients: int, probe_runs: int, journal_max: int) -> dict[str, Any]:
    redis = RedisServer()
    try:
        env = {"DETOUR_JOURNAL_MAX": str(journal_max), "DETOUR_REDIS_CALL_TIMEOUT_S": "0.05"}
        with ServiceProcess(redis_url=redis.url, env=env) as svc:
            pid = svc.proc.pid
            httpx.put(f"{svc.url}/routes/{TOPIC}", json=ROUTE, timeout=5).raise_for_status()
            time.sleep(1.0)  # settle: the allocator's first growth after the first requests
            idle = _status_kib(pid, "VmRSS")
            load = producing(svc.url, clients, seconds)
            after_load = _status_kib(pid, "VmHWM")
            degraded = fill_journal(svc.url, redis, journal_max)
            journal = httpx.get(f"{svc.url}/metrics", timeout=10).text
            held = next((float(line.split()[-1]) for line in journal.splitlines()
                         if line.startswith("detour_journal_reports")), 0.0)
            with_journal = _status_kib(pid, "VmHWM")
            probe = probes(svc.port, probe_runs)
    finally:
        redis.stop()
    return {
        "idle_rss_mib": _mib(idle),
        "producing": {**load, "peak_rss_mib": _mib(after_load)},
        "journal": {"max": journal_max, "answered_degraded": degraded,
                    "held": int(held), "peak_rss_mib": _mib(with_journal)},
        "probes": probe,
        "machine": {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2),
                    "python": sys.version.split()[0]},
    }


def markdown(r: dict[str, Any]) -> str:
    p, j = r["producing"], r["journal"]
    lines = [
        "| state | resident memory |",
        "|---|---|",
        f"| idle, table synced | {r['idle_rss_mib']} MiB |",
        f"| {p['clients']} cached clients sending for {p['seconds']:g} s ({p['sends']:,} "
        f"sends) | {p['peak_rss_mib']} MiB peak |",
        f"| Redis stopped, journal full ({j['held']:,} of {j['max']:,} reports) | "
        f"{j['peak_rss_mib']} MiB peak |",
        "",
        "| probe | wall, median (p95) | CPU per run | peak memory of one run |",
        "|---|---|---|---|",
    ]
    for name, v in r["probes"].items():
        lines.append(f"| {name} | {v['wall_ms_median']} ms ({v['wall_ms_p95']} ms) | "
                     f"{v['cpu_ms_per_run']} ms | {v['peak_rss_mib']} MiB |")
    m = r["machine"]
    lines += ["", f"({m['cpus']} CPUs, load {m['load_1m']} at the end, Python {m['python']})"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sidecar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0, help="producing phase, s")
    p.add_argument("--clients", type=int, default=4, help="SDK clients (threads)")
    p.add_argument("--probes", type=int, default=200, help="runs of each probe")
    p.add_argument("--journal-max", type=int, default=100_000,
                   help="DETOUR_JOURNAL_MAX of the measured sidecar (its default)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    result = run(args.seconds, args.clients, args.probes, args.journal_max)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sidecar.json").write_text(json.dumps(result, indent=2))
    (args.out / "sidecar.md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
