"""``python -m bench.batches [--runs 3]``: a batch costs its sender, not everyone.

Namespace a posts 1,000-report batches on two connections, back to back (a batch refused
while the other is applied is sent again after its Retry-After, as the SDK would);
namespace b sends single reports meanwhile. The target (issue 29): b's p99 within three
times its p99 with nothing beside it.

Every report is written to Redis at once (``DETOUR_REPORT_FLUSH_MS=0``) and each of a's
moves a window, so b's reports meet a's work in Redis and in the replica's event loop (the
scripts, and the pushes each change comes back as). A real ``python -m service`` on a real
redis-server, tokens for both namespaces, on 127.0.0.1. a's batches are posted by two
processes of their own (``http.client``, the body encoded once), so that their work does
not share b's interpreter; quiet and loaded windows alternate, ``ROUNDS`` of each, so that
the machine's own noise falls on both.

A latency ratio is a benchmark's to measure on a quiet machine: on 2 shared cores the two
posters and Detour take CPU that b then waits for, whatever Detour's fairness.
tests/test_batches.py runs one measurement and checks what holds on a busy machine too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.procs import PATIENT_ENV, RedisServer, ServiceProcess, end_process, write_tokens

A_TOKEN, B_TOKEN = "token-a-0123456789", "token-b-0123456789"
#: 1,000 reports that each move a window (a slow success), to as many brokers.
BATCH = {"reports": [{"brokerName": f"a-{i}", "latencyMs": 600} for i in range(1000)]}
ROUNDS = 3
SAMPLES = 150
#: the target: b's p99 beside a's batches over its p99 alone
TARGET_RATIO = 3.0
#: A process that posts the batch (argv[3], a file) to 127.0.0.1:argv[1] with token
#: argv[2] until it is stopped, printing a line once its first batch was applied. A batch
#: refused 503 (its namespace's other batch is being applied) is sent again after the
#: Retry-After, as the SDK would; any other answer stops it.
POSTER = r"""
import http.client, sys, time
port, token, body = int(sys.argv[1]), sys.argv[2], open(sys.argv[3], "rb").read()
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
headers = {"content-type": "application/json", "authorization": "Bearer " + token}
first = True
while True:
    conn.request("POST", "/report-latency:batch", body, headers)
    r = conn.getresponse()
    r.read()
    if r.status == 503:
        time.sleep(float(r.getheader("retry-after", "1")))
        continue
    if r.status != 200:
        sys.exit(f"batch answered {r.status}")
    if first:
        print("posting", flush=True)
        first = False
"""


def p99(samples: Sequence[float]) -> float:
    return statistics.quantiles(samples, n=100)[98]


@dataclass
class Result:
    """b's report latencies (s), alone and beside a's batches."""

    quiet: list[float]
    loaded: list[float]

    def row(self) -> dict[str, float]:
        return {
            "quiet_p50_ms": statistics.median(self.quiet) * 1000,
            "quiet_p99_ms": p99(self.quiet) * 1000,
            "loaded_p50_ms": statistics.median(self.loaded) * 1000,
            "loaded_p99_ms": p99(self.loaded) * 1000,
            "p99_ratio": p99(self.loaded) / p99(self.quiet),
        }


def b_reports(b: httpx.Client, n: int) -> list[float]:
    """Latencies (s) of ``n`` single reports of namespace b, one at a time."""
    out: list[float] = []
    for _ in range(n):
        start = time.perf_counter()
        r = b.post("/report-latency", json={"brokerName": "b-1", "latencyMs": 600})
        out.append(time.perf_counter() - start)
        if r.status_code != 200:
            raise RuntimeError(f"b's report answered {r.status_code}: {r.text}")
    return out


def measure(url: str, port: int, work: Path, rounds: int = ROUNDS) -> Result:
    """Alternate ``rounds`` quiet and loaded windows of b's reports against the Detour at
    ``url`` (namespaces a and b by ``A_TOKEN`` and ``B_TOKEN``)."""
    body = work / "batch.json"
    body.write_bytes(json.dumps(BATCH).encode())
    result = Result([], [])
    with httpx.Client(base_url=url, timeout=10,
                      headers={"authorization": f"Bearer {B_TOKEN}"}) as b:
        b_reports(b, 50)  # warm up
        for _ in range(rounds):
            result.quiet += b_reports(b, SAMPLES)
            posters = [subprocess.Popen(
                [sys.executable, "-c", POSTER, str(port), A_TOKEN, str(body)],
                stdout=subprocess.PIPE, text=True) for _ in range(2)]
            try:
                for p in posters:  # both are posting (their first batch was answered)
                    assert p.stdout is not None
                    if p.stdout.readline() != "posting\n":
                        raise RuntimeError("a poster stopped before its first batch")
                result.loaded += b_reports(b, SAMPLES)
                if any(p.poll() is not None for p in posters):
                    raise RuntimeError("a poster stopped")
            finally:
                for p in posters:
                    end_process(p, 10)
                    if p.stdout is not None:
                        p.stdout.close()
    return result


def detour_env(tokens: Path) -> dict[str, str]:
    """The Detour the measurement runs against: tokens for a and b, no flush delay."""
    return {**PATIENT_ENV, "DETOUR_TOKENS_FILE": str(tokens), "DETOUR_REPORT_FLUSH_MS": "0"}


def tokens_file(path: Path) -> Path:
    return write_tokens(path, {"a": (A_TOKEN, "producer", "a"), "b": (B_TOKEN, "producer", "b")})


def one_run(work: Path) -> Result:
    server = RedisServer()
    try:
        env = detour_env(tokens_file(work / "tokens.json"))
        with ServiceProcess(redis_url=server.url, env=env) as svc:
            return measure(svc.url, svc.port, work)
    finally:
        server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            work = Path(tmp) / f"run-{i}"
            work.mkdir()
            rows.append(one_run(work).row())
            print(json.dumps(rows[-1]), file=sys.stderr)
    print("| run | b alone p50 / p99 ms | b beside a's batches p50 / p99 ms | p99 ratio |")
    print("|---:|---|---|---:|")
    for i, r in enumerate(rows, 1):
        print(f"| {i} | {r['quiet_p50_ms']:.1f} / {r['quiet_p99_ms']:.1f} | "
              f"{r['loaded_p50_ms']:.1f} / {r['loaded_p99_ms']:.1f} | {r['p99_ratio']:.2f}x |")
    ratio = statistics.median(r["p99_ratio"] for r in rows)
    print(f"\nmedian p99 ratio {ratio:.2f}x (target ≤ {TARGET_RATIO:g}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
