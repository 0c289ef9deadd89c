"""The metrics listener (service/api/metrics_listener.py): GET /metrics alone on a second
address with its own tokens, so a sidecar on loopback can be scraped; checked on a real
process, and through a real Prometheus loading the alert rules while Redis goes away."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.api.metrics_listener import MAX_CONNECTIONS
from tests.procs import (
    PATIENT_ENV,
    ROOT,
    RedisServer,
    ServiceProcess,
    free_port,
    wait_until,
    write_tokens,
)
from tests.test_observability import SCRAPE_TOKEN, PrometheusServer, _alerts, _binary, _eventually

PRODUCER_TOKEN = "tok-producer"
PROD_SCRAPE_TOKEN = "tok-scrape-prod"


def _sidecar_env(tokens: Path, port: int, **extra: str) -> dict[str, str]:
    """The sidecar shape: the main listener on loopback without tokens, /metrics also on
    a second address with the tokens in ``tokens``."""
    return {**PATIENT_ENV, "DETOUR_METRICS_HOST": "127.0.0.1", "DETOUR_METRICS_PORT": str(port),
            "DETOUR_METRICS_TOKENS_FILE": str(tokens), **extra}


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[ServiceProcess, str]]:
    tokens = write_tokens(tmp_path / "metrics-tokens.json", {
        "prometheus": (SCRAPE_TOKEN, "metrics", "*"),
        "prod-scraper": (PROD_SCRAPE_TOKEN, "metrics", "prod"),
        "producer": (PRODUCER_TOKEN, "producer", "default"),
    })
    port = free_port()
    with ServiceProcess(env=_sidecar_env(tokens, port, DETOUR_HEADER_TIMEOUT_S="1")) as svc:
        yield svc, f"http://127.0.0.1:{port}"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.e2e
def test_the_listener_serves_metrics_only_and_only_to_a_scrape_token(
    sidecar: tuple[ServiceProcess, str],
) -> None:
    svc, metrics_url = sidecar
    # The producer's side is untouched: open on loopback, /metrics there too.
    route = {"brokers": [{"brokerName": "a", "writeQueueNums": 1}]}
    httpx.put(f"{svc.url}/routes/t", json=route, timeout=5).raise_for_status()
    assert httpx.post(f"{svc.url}/select", json={"topic": "t"}, timeout=5).status_code == 200
    assert httpx.get(f"{svc.url}/metrics", timeout=5).status_code == 200

    with httpx.Client(base_url=metrics_url, timeout=5) as http:
        r = http.get("/metrics")
        assert r.status_code == 401 and r.json()["error"] == "UNAUTHORIZED"
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert http.get("/metrics", headers=_bearer("wrong")).status_code == 401
        r = http.get("/metrics", headers=_bearer(PRODUCER_TOKEN))
        assert r.status_code == 403 and r.json()["error"] == "FORBIDDEN"
        # Nothing but /metrics, nothing but GET, whatever the token.
        for method, path, status in (("GET", "/select", 404), ("GET", "/readyz", 404),
                                     ("POST", "/metrics", 405), ("GET", "/", 404)):
            r = http.request(method, path, headers=_bearer(SCRAPE_TOKEN))
            assert r.status_code == status, (method, path, r.status_code)
            assert set(r.json()) == {"error", "message", "field"}
        r = http.post("/metrics", headers=_bearer(SCRAPE_TOKEN))
        assert r.headers["allow"] == "GET"

        # The token for every namespace sees the table and the process's own series; one
        # for another namespace sees only the process's.
        ok = http.get("/metrics", headers=_bearer(SCRAPE_TOKEN))
        assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/plain")
        assert 'detour_store_degraded{namespace="default"} 0.0' in ok.text
        assert 'detour_broker_avoided{broker="a",namespace="default"} 0.0' in ok.text
        assert 'detour_selects_total{decision="available",namespace="default"}' in ok.text
        prod = http.get("/metrics", headers=_bearer(PROD_SCRAPE_TOKEN)).text
        assert 'namespace="default"' not in prod and "detour_journal_reports" in prod
        # One connection, many scrapes (Prometheus keeps it open).
        for _ in range(3):
            assert http.get("/metrics", headers=_bearer(SCRAPE_TOKEN)).status_code == 200


def _closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """True when the peer closes ``sock`` (EOF or reset) within ``timeout_s``."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.e2e
def test_the_listener_bounds_connections_heads_and_bodies(
    sidecar: tuple[ServiceProcess, str],
) -> None:
    _, metrics_url = sidecar
    port = int(metrics_url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5)
            for _ in range(MAX_CONNECTIONS)]
    try:
        # Past the cap a connection is closed at once, unanswered: a whole scrape sent on it
        # gets no response.
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        with extra:
            try:
                extra.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                              + SCRAPE_TOKEN.encode() + b"\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed before the request went out: what is asserted next
            assert _closed_by_peer(extra, 5)
        # A head that never ends is dropped after DETOUR_HEADER_TIMEOUT_S (1 s here).
        idle[0].sendall(b"GET /metrics HTTP/1.1\r\n")
        assert _closed_by_peer(idle[0], 10)
    finally:
        for s in idle:
            s.close()
    # The slots are free again: a scrape is served.
    wait_until(lambda: httpx.get(f"{metrics_url}/metrics", headers=_bearer(SCRAPE_TOKEN),
                                 timeout=5).status_code == 200, 10, "a scrape after the idle ones")
    # A body is refused (nothing past the head is read) and the connection closed.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 400 ") and b"Connection: close" in answer
    # A head larger than the limit is dropped.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: " + b"x" * 20_000 + b"\r\n\r\n")
        assert _closed_by_peer(s, 10)


@pytest.mark.integration
@pytest.mark.parametrize(("env", "says"), [
    # The pod IP without a token: anyone who reaches it could scrape.
    ({"DETOUR_METRICS_HOST": "10.1.2.3"}, "DETOUR_METRICS_TOKENS_FILE"),
    ({"DETOUR_METRICS_HOST": "127.0.0.1", "DETOUR_METRICS_PORT": "{port}"}, "port of its own"),
    ({"DETOUR_METRICS_HOST": "10.1.2.3", "DETOUR_METRICS_TOKENS_FILE": "/nonexistent/t.yaml"},
     "/nonexistent/t.yaml"),
])
def test_a_listener_that_would_be_open_or_clash_stops_the_start(
    env: dict[str, str], says: str
) -> None:
    port = str(free_port())
    r = subprocess.run([sys.executable, "-m", "service", "--port", port],
                       env={k: v.format(port=port) for k, v in env.items()} | {
                           "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr, r.stderr


# ------------------------------------------------------------- a real Prometheus, live
@pytest.mark.e2e
@pytest.mark.slow
def test_a_sidecar_is_observed_through_its_listener(tmp_path: Path) -> None:
    """What the sidecar shape could not show before: a real Prometheus scrapes the listener
    of a loopback Detour (no tokens on its main listener) with a metrics token, sees the
    isolation ticket, and when Redis goes away sees the replica degraded and journaling, with
    DetourStoreDegraded pending."""
    binary = _binary("prometheus")
    tokens = write_tokens(tmp_path / "metrics-tokens.json",
                          {"prometheus": (SCRAPE_TOKEN, "metrics", "*")})
    port = free_port()
    target = f"127.0.0.1:{port}"
    alerts = _alerts()
    with contextlib.ExitStack() as stack:
        redis = RedisServer()
        stack.callback(redis.stop)
        svc = stack.enter_context(ServiceProcess(redis_url=redis.url,
                                                 env=_sidecar_env(tokens, port)))
        prom = PrometheusServer(binary, tmp_path, target)
        stack.callback(prom.stop)
        _eventually(prom, "the listener scraped",
                    lambda: prom.values('up{job="detour"}', "instance") == {target: 1.0})
        with httpx.Client(base_url=svc.url, timeout=5) as api:  # open: the pod's loopback
            api.put("/routes/t", json={"brokers": [
                {"brokerName": b, "writeQueueNums": 1} for b in ("a", "b")]}).raise_for_status()
            api.post("/report-latency", json={"brokerName": "a", "latencyMs": 0,
                                              "isolation": True}).raise_for_status()
            _eventually(prom, "the ticket for a", lambda: prom.values(
                'ALERTS{alertname="DetourBrokerIsolated", alertstate="firing"}', "broker") == {
                "a": 1})
            assert prom.values(alerts["DetourStoreDegraded"]["expr"]) == {}

            redis.kill()
            # Redis is gone: the sidecar answers from its copy and journals the report.
            r = api.post("/report-latency", json={"brokerName": "b", "latencyMs": 0,
                                                  "isolation": True})
            assert r.status_code == 200 and r.json()["degraded"] is True
        _eventually(prom, "degraded and journaling, scraped", lambda: (
            prom.values('detour_store_degraded{job="detour"}', "instance") == {target: 1.0}
            and prom.values('detour_journal_reports{job="detour"}')[""] >= 1))
        assert prom.values(alerts["DetourStoreDegraded"]["expr"], "instance") == {target: 1.0}
        _eventually(prom, "DetourStoreDegraded pending", lambda: prom.values(
            'ALERTS{alertname="DetourStoreDegraded", alertstate="pending"}', "instance") == {
            target: 1.0})


@pytest.mark.integration
def test_a_metrics_port_in_use_stops_the_start() -> None:
    """The listener binds in the lifespan: a port someone else holds fails the start
    (uvicorn's exit 3) with the address, rather than a sidecar nobody can scrape."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "service", "--port", str(free_port()),
                            "--metrics-host", "127.0.0.1", "--metrics-port", str(busy)],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 3, r.stderr
    assert f"('127.0.0.1', {busy})" in r.stderr and "address already in use" in r.stderr
