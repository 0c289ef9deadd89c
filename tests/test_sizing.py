"""docs/deploy.md's "Sizing", held to the code, the manifests and real processes: Redis
connections per process (a real redis-server's CLIENT LIST), the stream caps, the fleet's
reserved requests, and what splitting into namespaces costs (no protection across them)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from service.app import create_app
from service.auth import TokenEntry, TokenTable, hash_token
from service.settings import Settings
from tests.asgi_client import TestClient
from tests.procs import PATIENT_ENV, ROOT, RedisServer, ServiceProcess, wait_until, write_tokens

DOC = ROOT / "docs" / "deploy.md"


def _sizing() -> str:
    return DOC.read_text(encoding="utf-8").split("\n## Sizing", 1)[1].split("\n## ", 1)[0]


def _isolate(url: str, broker: str, headers: dict[str, str] | None = None) -> None:
    httpx.post(f"{url}/report-latency", headers=headers, timeout=10, json={
        "brokerName": broker, "latencyMs": 0, "isolation": True}).raise_for_status()


def _says(url: str) -> dict[str, int]:
    """detour_store_redis_connections of the default namespace, by use, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith('detour_store_redis_connections{namespace="default",use="'):
            use = line.split('use="', 1)[1].split('"', 1)[0]
            out[use] = int(float(line.rsplit(" ", 1)[1]))
    return out


def _held(r: redis.Redis) -> tuple[int, int]:
    """(subscriptions, other connections) of the server's clients other than this one."""
    me = r.client_id()
    clients = [c for c in r.client_list() if int(c["id"]) != me]
    subs = sum(1 for c in clients if c.get("sub") == "1")
    return subs, len(clients) - subs


@pytest.mark.e2e
def test_redis_connections_per_process_are_the_documented_ones(tmp_path: Path) -> None:
    """2 per namespace at rest (the subscription and the poll's); a report that writes opens
    one more, closed once unused; a burst opens at most the maximum per client, and those
    close too."""
    doc = _sizing()
    assert "**2 per namespace at rest**" in doc and "3 once a" in doc
    assert "`DETOUR_REDIS_MAX_CONNECTIONS` (16)" in doc and Settings().redis_max_connections == 16
    assert "`DETOUR_REDIS_IDLE_CLOSE_S` (10 s)" in doc and Settings().redis_idle_close_s == 10
    store = RedisServer()
    most = 3
    # Idle connections close after 1.5 s: short, so the test sees them go, and not so short
    # that one closes mid-burst on a busy machine (a thread starved that long), when the
    # server may still list the closing one beside its replacement for a moment.
    env = {**PATIENT_ENV, "DETOUR_REDIS_IDLE_CLOSE_S": "1.5",
           "DETOUR_REDIS_MAX_CONNECTIONS": str(most)}
    try:
        r = store.client()
        with ServiceProcess(redis_url=store.url, env=env) as svc:
            wait_until(lambda: _held(r) == (1, 1), 10, "2 connections at rest")
            # ... and the process says so, by use (the metric docs/deploy.md names)
            assert "`detour_store_redis_connections{namespace, use}`" in doc
            wait_until(lambda: _says(svc.url) == {"subscription": 1, "commands": 1,
                                                  "reports": 0, "replica": 0}, 10,
                       "detour_store_redis_connections: 1 subscription, 1 for commands")
            _isolate(svc.url, "b0")
            wait_until(lambda: _held(r) == (1, 2), 10, "3 once a report has written")
            wait_until(lambda: _held(r) == (1, 1), 10, "back to 2 once it is unused")
            threads = 16
            answered: list[int] = []
            seen: list[int] = []
            done = threading.Event()

            def burst(k: int) -> None:
                with httpx.Client(base_url=svc.url, timeout=10) as c:
                    for j in range(10):
                        r = c.post("/report-latency", json={"brokerName": f"b{k}-{j}",
                                                            "latencyMs": 0, "isolation": True})
                        # A busy machine may shed some (503 SYSTEM_BUSY, refused at once,
                        # never reaching Redis); the others each took a connection's turn.
                        assert r.status_code == 200 or r.json()["error"] == "SYSTEM_BUSY", r.text
                        answered.append(r.status_code)

            def watch() -> None:
                with store.client() as w:
                    while not done.is_set():
                        seen.append(sum(_held(w)))
                        done.wait(0.005)

            watcher = threading.Thread(target=watch)
            watcher.start()
            workers = [threading.Thread(target=burst, args=(k,)) for k in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(60)
            done.set()
            watcher.join(10)
            assert len(answered) == threads * 10 and answered.count(200) >= threads, answered
            # 16 reports at once wait for the reports' client's 3 connections; the other
            # client (the subscription, polls) holds at most its own 3.
            assert 3 <= max(seen) <= 2 * most, max(seen)
            wait_until(lambda: _held(r) == (1, 1), 10, "back to 2 after the burst")
        r.close()

        # Two namespaces: a store, a subscription and a poll each.
        tokens = write_tokens(tmp_path / "tokens.json", {
            "a": ("tok-a", "admin", "ns1"), "b": ("tok-b", "admin", "ns2")})
        r = store.client()
        r.flushall()
        with ServiceProcess(redis_url=store.url, env={**PATIENT_ENV,
                                                      "DETOUR_TOKENS_FILE": str(tokens)}):
            wait_until(lambda: _held(r) == (2, 2), 10, "2 per namespace at rest")
        r.close()
    finally:
        store.stop()


@pytest.mark.unit
def test_the_stream_caps_and_fleet_requests_are_the_documented_ones() -> None:
    doc = _sizing()
    s = Settings()
    assert f"`DETOUR_STREAM_MAX_PER_TOKEN` ({s.stream_max_per_token})" in doc
    assert f"`DETOUR_STREAM_MAX` ({s.stream_max})" in doc
    assert f"`DETOUR_MAX_CONNECTIONS`, {s.max_connections}" in doc
    # 1,000 cached producers on one token: ceil(1000 / 100) replicas at the planned 100.
    assert "1,000 cached producers on one token need 10 replicas" in doc
    # The sidecar's requests over 1,000 pods, from the manifest itself.
    producer = yaml.safe_load((ROOT / "deploy/overlays/sidecar/producer.yaml").read_text())
    (sidecar,) = producer["spec"]["template"]["spec"]["initContainers"]
    requests = sidecar["resources"]["requests"]
    assert requests == {"cpu": "100m", "memory": "128Mi"}
    cores = 1000 * int(requests["cpu"].removesuffix("m")) / 1000
    gib = 1000 * int(requests["memory"].removesuffix("Mi")) / 1024
    assert f"1,000 producer pods\nreserve **{cores:.0f} cores and {gib:.0f} GiB**" in doc
    base = yaml.safe_load((ROOT / "deploy/base/deployment.yaml").read_text())
    (container,) = base["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == {"cpu": "500m", "memory": "128Mi"}
    assert "3 to 10 × 500m" in doc and "1.5 to 5 cores" in doc


@pytest.mark.integration
def test_producers_in_different_namespaces_do_not_protect_each_other() -> None:
    """The cost of a split, as the doc states it: a broker isolated by one namespace's
    producer is still selected by another namespace's, until one of theirs fails on it."""
    assert "producers in different namespaces no longer protect\neach other" in _sizing()
    tokens = TokenTable([
        TokenEntry(name=n, sha256=hash_token(f"tok-{n}"), role="admin", namespace=n)
        for n in ("ns1", "ns2")])
    route: dict[str, Any] = {"brokers": [{"brokerName": b, "writeQueueNums": 1}
                                         for b in ("a", "b")]}
    with TestClient(create_app(Settings(), tokens=tokens)) as client:
        auth = {n: {"Authorization": f"Bearer tok-{n}"} for n in ("ns1", "ns2")}
        for n in auth:
            client.put("/routes/t", json=route, headers=auth[n]).raise_for_status()
        client.post("/report-latency", headers=auth["ns1"], json={
            "brokerName": "a", "latencyMs": 0, "isolation": True}).raise_for_status()

        def picks(n: str) -> set[str]:
            return {client.post("/select", json={"topic": "t"}, headers=auth[n]).json()[
                "brokerName"] for _ in range(8)}

        assert picks("ns1") == {"b"}
        assert picks("ns2") == {"a", "b"}  # ns2's producers still send to the failed broker
        client.post("/report-latency", headers=auth["ns2"], json={
            "brokerName": "a", "latencyMs": 0, "isolation": True}).raise_for_status()
        assert picks("ns2") == {"b"}  # only after a failure of their own


@pytest.mark.unit
def test_reliability_and_benchmarks_link_the_sizing_section() -> None:
    assert "\n## Sizing\n" in DOC.read_text(encoding="utf-8")
    for name in ("reliability.md", "BENCHMARKS.md"):
        assert "(deploy.md#sizing)" in (ROOT / "docs" / name).read_text(encoding="utf-8"), name
    reliability = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    assert "not\nbuilt yet" not in reliability and "not built yet" not in reliability
    assert "[security.md](security.md)" in reliability.split("\n## ", 1)[0]
