"""How long a fault reported to one replica takes to steer another replica's /select.

Replicas learn of each other's writes from Redis pub/sub, so this is the
window in which two producers sharing the table can still disagree. Two Detour
processes (A, B) share one redis-server; the harness reports an isolation to A
and polls B's /select in a tight keep-alive loop until B avoids the broker,
then restores the broker on A and polls B until it selects it again.

Detection is unambiguous in a single select. The route has two brokers with
one queue each, the tested broker T and a healthy broker H, and B is asked with
``lastBrokerName: H``. If T is available, B returns T wherever its round-robin
walk starts (H is the last broker, so it is only a fallback). If T is avoided,
B returns H and lists T in ``avoidedBrokers``. So "B returned H" means "B has
seen the isolation" and "B returned T" means "B has seen the restore", with
no dependence on the round-robin counter.

Times are taken in the harness, from A's response arriving to B's first
changed answer arriving; each value therefore includes at least one B round
trip (its distribution without pending changes is reported as ``poll_rtt``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from tests.procs import RedisServer, ServiceProcess, wait_until

TOPIC = "propagation"
BROKERS = ("broker-x", "broker-y")


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (the smallest value with at least p% of values <= it)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def distribution(values: Sequence[float]) -> dict[str, float | int]:
    return {
        "n": len(values),
        "min": min(values, default=math.nan),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values, default=math.nan),
        "mean": sum(values) / len(values) if values else math.nan,
    }


def _select_on(b: httpx.Client, tested: str, healthy: str) -> dict[str, Any]:
    r = b.post("/select", json={"topic": TOPIC, "lastBrokerName": healthy})
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    return body


def _wait_for(
    b: httpx.Client, tested: str, healthy: str, avoided: bool, deadline_s: float
) -> tuple[float | None, int, int]:
    """Poll B until it avoids (or selects again) ``tested``.

    Returns (time the changed answer arrived or None on timeout, polls, anomalies);
    an anomaly is an answer that is neither state (T chosen while listed as
    avoided, or H chosen without T in ``avoidedBrokers``).
    """
    polls = anomalies = 0
    deadline = time.perf_counter() + deadline_s
    while time.perf_counter() < deadline:
        body = _select_on(b, tested, healthy)
        now = time.perf_counter()
        polls += 1
        chose_tested = body["brokerName"] == tested
        listed = tested in body["avoidedBrokers"]
        if chose_tested == listed:
            anomalies += 1
        if avoided and not chose_tested and listed:
            return now, polls, anomalies
        if not avoided and chose_tested:
            return now, polls, anomalies
    return None, polls, anomalies


def run_propagation(
    *,
    iterations: int = 200,
    deadline_s: float = 2.0,
    log_dir: Path | None = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Isolate and restore a broker ``iterations`` times; every wait bounded by ``deadline_s``."""
    isolate_ms: list[float] = []
    isolate_from_send_ms: list[float] = []
    clear_ms: list[float] = []
    isolate_polls: list[int] = []
    clear_polls: list[int] = []
    timeouts = {"isolate": 0, "clear": 0}
    anomalies = 0
    with ExitStack() as stack:
        redis = RedisServer()
        stack.callback(redis.stop)
        a_proc = ServiceProcess(
            redis_url=redis.url, log_path=log_dir / "replica-a.log" if log_dir else None
        )
        stack.callback(a_proc.stop)
        b_proc = ServiceProcess(
            redis_url=redis.url, log_path=log_dir / "replica-b.log" if log_dir else None
        )
        stack.callback(b_proc.stop)
        a = stack.enter_context(httpx.Client(base_url=a_proc.url, timeout=deadline_s))
        b = stack.enter_context(httpx.Client(base_url=b_proc.url, timeout=deadline_s))

        brokers = [{"brokerName": x, "writeQueueNums": 1} for x in BROKERS]
        a.put(f"/routes/{TOPIC}", json={"brokers": brokers}).raise_for_status()
        # B learns the route by push too; until then it answers 404.
        wait_until(
            lambda: b.post("/select", json={"topic": TOPIC}).status_code == 200,
            deadline_s, "route on replica B",
        )  # fmt: skip

        # The measurement's resolution: B's select round trip when nothing changes.
        rtt: list[float] = []
        for i in range(200):
            t0 = time.perf_counter()
            _select_on(b, BROKERS[i % 2], BROKERS[(i + 1) % 2])
            rtt.append((time.perf_counter() - t0) * 1000)

        for i in range(iterations):
            tested, healthy = BROKERS[i % 2], BROKERS[(i + 1) % 2]
            sent = time.perf_counter()
            r = a.post("/report-latency",
                       json={"brokerName": tested, "latencyMs": 100, "isolation": True})
            acked = time.perf_counter()
            r.raise_for_status()
            if r.json()["notAvailableDurationMs"] <= 0:
                raise RuntimeError(f"the isolation opened no window: {r.json()}")
            seen, polls, bad = _wait_for(b, tested, healthy, True, deadline_s)
            anomalies += bad
            if seen is None:
                timeouts["isolate"] += 1
            else:
                isolate_ms.append((seen - acked) * 1000)
                isolate_from_send_ms.append((seen - sent) * 1000)
                isolate_polls.append(polls)

            r = a.delete(f"/fault-items/{tested}")
            acked = time.perf_counter()
            if r.status_code != 204:
                raise RuntimeError(f"restore failed: {r.status_code} {r.text}")
            seen, polls, bad = _wait_for(b, tested, healthy, False, deadline_s)
            anomalies += bad
            if seen is None:
                timeouts["clear"] += 1
                # The next iteration needs B to have seen the restore; do not measure on.
                raise RuntimeError(f"replica B never saw {tested} restored within {deadline_s}s")
            clear_ms.append((seen - acked) * 1000)
            clear_polls.append(polls)
            if (i + 1) % 50 == 0:
                progress(f"  propagation {i + 1}/{iterations}")

    return {
        "iterations": iterations,
        "deadline_s": deadline_s,
        "isolate_ms": distribution(isolate_ms),
        "isolate_from_send_ms": distribution(isolate_from_send_ms),
        "clear_ms": distribution(clear_ms),
        "poll_rtt_ms": distribution(rtt),
        "isolate_polls": distribution([float(p) for p in isolate_polls]),
        "clear_polls": distribution([float(p) for p in clear_polls]),
        "timeouts": timeouts,
        "anomalies": anomalies,
        "raw": {"isolate_ms": isolate_ms, "clear_ms": clear_ms},
    }


def to_markdown(result: dict[str, Any], target_p99_ms: float = 10.0) -> str:
    def row(label: str, d: dict[str, Any]) -> str:
        return (
            f"| {label} | {d['n']} | {d['p50']:.2f} | {d['p95']:.2f} | {d['p99']:.2f} "
            f"| {d['max']:.2f} |"
        )

    iso = result["isolate_ms"]
    met = iso["p99"] < target_p99_ms
    return "\n".join(
        [
            "| replica B sees ... (ms) | n | p50 | p95 | p99 | max |",
            "|---|---:|---:|---:|---:|---:|",
            row("isolation, from A's response", iso),
            row("isolation, from A's request sent", result["isolate_from_send_ms"]),
            row("restore (DELETE), from A's response", result["clear_ms"]),
            row("B's select round trip, nothing pending", result["poll_rtt_ms"]),
            "",
            f"Polls of B until it avoided the broker: median {result['isolate_polls']['p50']:.0f}, "
            f"max {result['isolate_polls']['max']:.0f}. Timeouts ({result['deadline_s']} s): "
            f"{result['timeouts']}. Inconsistent answers: {result['anomalies']}.",
            f"Target p99 < {target_p99_ms:g} ms for isolation propagation: "
            f"{'met' if met else 'NOT met'} ({iso['p99']:.2f} ms).",
        ]
    )
