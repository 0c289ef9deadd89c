"""Tokens, roles and namespaces: who may call what, and one tenant never touches another."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from pydantic import ValidationError

from detour.client import DetourClient
from service.app import create_app
from service.auth import (
    Role,
    TokenEntry,
    TokenTable,
    check_exposure,
    hash_token,
    parse_tokens,
)
from service.settings import Settings
from tests.asgi_client import TestClient
from tests.procs import ROOT, ServiceProcess, wait_until

TOKENS = {
    "admin-a": ("tok-admin-a", Role.ADMIN, "a"),
    "prod-a": ("tok-prod-a", Role.PRODUCER, "a"),
    "admin-b": ("tok-admin-b", Role.ADMIN, "b"),
    "prod-b": ("tok-prod-b", Role.PRODUCER, "b"),
    "scrape-b": ("tok-scrape-b", Role.METRICS, "b"),
    "scrape-all": ("tok-scrape-all", Role.METRICS, "*"),
}
ROUTE = {"brokers": [{"brokerName": "x", "writeQueueNums": 2},
                     {"brokerName": "y", "writeQueueNums": 2}]}


def table() -> TokenTable:
    return TokenTable([
        TokenEntry(name=name, sha256=hash_token(tok), role=role, namespace=ns)
        for name, (tok, role, ns) in TOKENS.items()
    ])


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name][0]}"}


@pytest.fixture
def app_client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, table())) as c:
        yield c


# -- the pure parts -----------------------------------------------------------

@pytest.mark.unit
def test_lookup_matches_only_the_exact_token() -> None:
    t = table()
    found = t.lookup("tok-prod-b")
    assert found is not None and (found.name, found.role, found.namespace) == (
        "prod-b", Role.PRODUCER, "b")
    for guess in ("tok-prod-", "tok-prod-bb", "", "TOK-PROD-B", hash_token("tok-prod-b")):
        assert t.lookup(guess) is None
    assert t.namespaces == ["a", "b"]


@pytest.mark.unit
def test_tokens_file_is_validated_with_the_field_named() -> None:
    good = json.dumps([{"name": "n", "sha256": hash_token("s"), "role": "admin",
                        "namespace": "a"}])
    assert parse_tokens(good, "inline").lookup("s") is not None
    cases = {
        '{"tokens": [{"name": "n", "sha256": "zz", "role": "admin", "namespace": "a"}]}':
            "tokens.0.sha256",
        f'[{{"name": "n", "sha256": "{hash_token("s")}", "role": "root", "namespace": "a"}}]':
            "tokens.0.role",
        f'[{{"name": "n", "sha256": "{hash_token("s")}", "role": "admin", "namespace": "a/b"}}]':
            "tokens.0.namespace",
        "tokens: [": "not YAML",
        "[]": "tokens",
    }
    for text, expected in cases.items():
        with pytest.raises(ValueError, match=expected.replace(".", r"\.")):
            parse_tokens(text, "f")
    dup = json.dumps([{"name": "n", "sha256": hash_token(s), "role": "admin", "namespace": "a"}
                      for s in ("s", "t")])
    with pytest.raises(ValueError, match="unique"):
        parse_tokens(dup, "f")


@pytest.mark.unit
def test_open_service_must_stay_on_loopback_unless_told() -> None:
    empty = TokenTable(())
    for host in ("127.0.0.1", "127.0.0.53", "::1", "localhost"):
        assert check_exposure(Settings(host=host), empty) is None
    refusal = check_exposure(Settings(host="0.0.0.0"), empty)
    assert refusal is not None and "--allow-open" in refusal
    assert check_exposure(Settings(host="0.0.0.0", allow_open=True), empty) is None
    assert check_exposure(Settings(host="0.0.0.0"), table()) is None


# -- through the app, on both stores --------------------------------------------

@pytest.mark.integration
def test_missing_or_wrong_token_is_401(app_client: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"},
                    {"Authorization": "Bearer "}):
        r = app_client.post("/select", json={"topic": "t"}, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"] == "UNAUTHORIZED" and r.json()["field"] == "Authorization"
        assert r.headers["www-authenticate"].startswith("Bearer")
    # Probes and the page stay open for Kubernetes; a scrape needs a token.
    for path in ("/healthz", "/readyz", "/", "/openapi.json"):
        assert app_client.get(path).status_code == 200, path
    assert app_client.get("/metrics").status_code == 401


@pytest.mark.integration
def test_producer_role_may_select_and_report_only(app_client: TestClient) -> None:
    assert app_client.put("/routes/t", json=ROUTE, headers=auth("admin-a")).status_code == 200
    p = auth("prod-a")
    assert app_client.post("/select", json={"topic": "t"}, headers=p).status_code == 200
    r = app_client.post("/report-latency", json={"brokerName": "x", "latencyMs": 5}, headers=p)
    assert r.status_code == 200
    batch = {"reports": [{"brokerName": "y", "latencyMs": 5}]}
    assert app_client.post("/report-latency:batch", json=batch, headers=p).status_code == 200
    before = app_client.get("/fault-items", headers=auth("admin-a")).json()["items"]
    for method, path, body in (
        ("PATCH", "/config", {}),
        ("PUT", "/routes/t", {"brokers": [{"brokerName": "z", "writeQueueNums": 1}]}),
        ("DELETE", "/routes/t", None),
        ("GET", "/fault-items", None),
        ("DELETE", "/fault-items/x", None),
        ("GET", "/latency-log", None),
    ):
        r = app_client.request(method, path, json=body, headers=p)
        assert r.status_code == 403, (method, path)
        assert r.json()["error"] == "FORBIDDEN"
    # Reads a producer needs to decide alone when Detour is unreachable (SDK fail-open).
    assert app_client.get("/config", headers=p).status_code == 200
    assert [r["topic"] for r in app_client.get("/routes", headers=p).json()["routes"]] == ["t"]
    assert app_client.get("/routes/t", headers=p).status_code == 200
    admin = auth("admin-a")
    assert app_client.get("/routes/t", headers=admin).json()["brokers"][0]["brokerName"] == "x"
    assert app_client.get("/fault-items", headers=admin).json()["items"] == before


@pytest.mark.integration
def test_namespaces_are_separate_tables(app_client: TestClient) -> None:
    a, b = auth("admin-a"), auth("admin-b")
    assert app_client.put("/routes/t", json=ROUTE, headers=a).status_code == 200
    assert app_client.patch("/config", json={"lastReportWins": True}, headers=a).status_code == 200
    r = app_client.post("/report-latency", json={"brokerName": "x", "latencyMs": 0,
                                                 "isolation": True}, headers=auth("prod-a"))
    assert r.json()["notAvailableDurationMs"] == 600000
    # b sees none of it: no route, no fault item, its own default config.
    assert app_client.post("/select", json={"topic": "t"},
                           headers=auth("prod-b")).status_code == 404
    assert app_client.get("/fault-items", headers=b).json()["items"] == []
    assert app_client.get("/config", headers=b).json()["lastReportWins"] is False
    assert app_client.get("/routes", headers=b).json()["routes"] == []
    # a's selects avoid x; b registering the same topic gets an independent route.
    assert app_client.put("/routes/t", json=ROUTE, headers=b).status_code == 200
    picks_a = {app_client.post("/select", json={"topic": "t"},
                               headers=auth("prod-a")).json()["brokerName"] for _ in range(6)}
    picks_b = {app_client.post("/select", json={"topic": "t"},
                               headers=auth("prod-b")).json()["brokerName"] for _ in range(6)}
    assert picks_a == {"y"} and picks_b == {"x", "y"}


@pytest.mark.integration
def test_cross_namespace_attempts_are_refused_and_change_nothing(app_client: TestClient) -> None:
    b = auth("admin-b")
    app_client.put("/routes/t", json=ROUTE, headers=b)
    before = (app_client.get("/routes", headers=b).json(),
              app_client.get("/fault-items", headers=b).json()["items"],
              app_client.get("/config", headers=b).json())
    to_b = {"X-Detour-Namespace": "b"}
    for name in ("admin-a", "prod-a"):
        for method, path, body in (
            ("POST", "/report-latency", {"brokerName": "x", "latencyMs": 0, "isolation": True}),
            ("PUT", "/routes/t", {"brokers": [{"brokerName": "evil", "writeQueueNums": 1}]}),
            ("PATCH", "/config", {"sendLatencyFaultEnable": False}),
            ("DELETE", "/routes/t", None),
            ("POST", "/select", {"topic": "t"}),
        ):
            r = app_client.request(method, path, json=body, headers={**auth(name), **to_b})
            assert r.status_code == 403, (name, method, path)
            assert r.json()["field"] == "X-Detour-Namespace"
    after = (app_client.get("/routes", headers=b).json(),
             app_client.get("/fault-items", headers=b).json()["items"],
             app_client.get("/config", headers=b).json())
    assert after == before
    # Naming one's own namespace is fine.
    r = app_client.post("/select", json={"topic": "t"},
                        headers={**auth("prod-b"), **to_b})
    assert r.status_code == 200


@pytest.mark.integration
def test_reports_carry_the_token_identity(app_client: TestClient) -> None:
    p = auth("prod-a")
    app_client.post("/report-latency", json={"brokerName": "x", "latencyMs": 7,
                                             "producer": "exec-1"}, headers=p)
    app_client.post("/report-latency", json={"brokerName": "x", "latencyMs": 8}, headers=p)
    app_client.post("/report-latency:batch", json={"reports": [
        {"brokerName": "x", "latencyMs": 9, "producer": "admin-a"}]}, headers=p)
    want = ["prod-a", "prod-a/admin-a", "prod-a/exec-1"]

    def producers() -> list[str]:
        log = app_client.get("/latency-log", headers=auth("admin-a")).json()["entries"]
        return sorted(e["producer"] for e in log)

    # On Redis the reports that change no window reach the log with the replica's next
    # flush (docs/semantics.md), one histogram per producer: poll until it came.
    wait_until(lambda: producers() == want, 10, "the reports in the latency log", 0.1)
    assert producers() == want


@pytest.mark.integration
def test_redis_keys_are_scoped_by_namespace(redis_url: str) -> None:
    settings = Settings(redis_url=redis_url, redis_prefix="authtest")
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    with TestClient(create_app(settings, table())) as c:
        c.put("/routes/t", json=ROUTE, headers=auth("admin-a"))
        c.post("/report-latency", json={"brokerName": "x", "latencyMs": 0, "isolation": True},
               headers=auth("prod-a"))
    keys = set(raw.scan_iter("authtest:*"))
    assert keys and all(k.startswith("authtest:{a}:") for k in keys), keys
    raw.close()


@pytest.mark.integration
def test_metrics_are_labelled_by_namespace(app_client: TestClient) -> None:
    app_client.put("/routes/t", json=ROUTE, headers=auth("admin-b"))
    app_client.post("/report-latency", json={"brokerName": "x", "latencyMs": 0,
                                             "isolation": True}, headers=auth("prod-b"))
    text = app_client.get("/metrics", headers=auth("scrape-all")).text
    assert 'detour_broker_avoided{broker="x",namespace="b"} 1.0' in text
    assert 'detour_broker_avoided{broker="x",namespace="a"}' not in text
    assert 'detour_brokers_avoided{namespace="a"} 0.0' in text


@pytest.mark.integration
def test_a_scrape_shows_only_its_tokens_namespace(app_client: TestClient) -> None:
    app_client.post("/report-latency", json={"brokerName": "x", "latencyMs": 0,
                                             "isolation": True}, headers=auth("prod-b"))
    assert app_client.get("/metrics", headers=auth("prod-b")).status_code == 403
    for name in ("scrape-b", "admin-b"):
        r = app_client.get("/metrics", headers=auth(name))
        assert r.status_code == 200, name
        assert 'detour_brokers_avoided{namespace="b"} 1.0' in r.text
        assert 'namespace="a"' not in r.text, name
        assert "detour_http_request_duration_seconds" in r.text  # the process's own
    text = app_client.get("/metrics", headers=auth("admin-a")).text
    assert 'namespace="b"' not in text and 'detour_brokers_avoided{namespace="a"} 0.0' in text
    # A metrics token may scrape and nothing else.
    assert app_client.post("/select", json={"topic": "t"},
                           headers=auth("scrape-b")).status_code == 403
    assert app_client.get("/config", headers=auth("scrape-all")).status_code == 403


@pytest.mark.unit
def test_only_a_metrics_token_may_name_every_namespace() -> None:
    with pytest.raises(ValidationError, match="for role 'metrics' only"):
        TokenEntry(name="n", sha256=hash_token("s"), role=Role.ADMIN, namespace="*")
    with pytest.raises(ValueError, match="at least one token"):
        TokenTable([TokenEntry(name="n", sha256=hash_token("s"), role=Role.METRICS,
                               namespace="*")])
    assert table().namespaces == ["a", "b"]


# -- the real process ------------------------------------------------------------

@pytest.mark.e2e
def test_open_service_refuses_a_public_address() -> None:
    r = subprocess.run([sys.executable, "-m", "service", "--host", "0.0.0.0", "--port", "1"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2
    assert "no tokens" in r.stderr and "--allow-open" in r.stderr


@pytest.mark.e2e
def test_bad_tokens_file_stops_the_start(tmp_path: Path) -> None:
    f = tmp_path / "tokens.yaml"
    f.write_text("tokens:\n  - name: x\n    sha256: nothex\n    role: admin\n    namespace: a\n")
    r = subprocess.run([sys.executable, "-m", "service", "--tokens-file", str(f)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "tokens.0.sha256" in r.stderr


@pytest.mark.integration
def test_token_cli_writes_the_token_to_a_file_only_its_owner_reads(tmp_path: Path) -> None:
    """`--token-file`: the token alone in a 0600 file (what a scrape config or a Secret
    reads), not on stderr; the printed entry is its digest."""
    path = tmp_path / "detour-metrics-token"
    path.write_text("old")
    out = subprocess.run(
        [sys.executable, "-m", "service.auth", "new", "--name", "prometheus", "--role",
         "metrics", "--namespace", "*", "--token-file", str(path)],
        capture_output=True, text=True, timeout=60, check=True, cwd=ROOT)
    token = path.read_text()
    assert token.startswith("dtr_") and token == token.strip()
    assert path.stat().st_mode & 0o777 == 0o600
    assert token not in out.stderr and str(path) in out.stderr
    entry = json.loads(out.stdout)
    assert entry["sha256"] == hash_token(token) and entry["role"] == "metrics"
    assert parse_tokens(json.dumps([entry, {"name": "p", "sha256": "0" * 64,
                                            "role": "producer", "namespace": "a"}]),
                        "x").lookup(token) is not None


@pytest.mark.e2e
def test_token_cli_and_sdk_against_the_live_service(tmp_path: Path) -> None:
    made = {}
    for name, role in (("ops", "admin"), ("spark", "producer")):
        out = subprocess.run(
            [sys.executable, "-m", "service.auth", "new", "--name", name, "--role", role,
             "--namespace", "prod"], capture_output=True, text=True, timeout=60, check=True,
            cwd=ROOT)
        token = out.stderr.strip().rsplit(" ", 1)[-1]
        made[name] = (token, json.loads(out.stdout))
    f = tmp_path / "tokens.yaml"
    f.write_text("tokens:\n" + "".join(f"  - {json.dumps(e)}\n" for _, e in made.values()))
    assert all(e["sha256"] != t for t, e in made.values())  # only digests at rest
    with ServiceProcess(env={"DETOUR_TOKENS_FILE": str(f)}) as svc:
        admin = {"Authorization": f"Bearer {made['ops'][0]}"}
        r = httpx.put(f"{svc.url}/routes/t", json=ROUTE, headers=admin, timeout=5)
        assert r.status_code == 200
        assert httpx.post(f"{svc.url}/select", json={"topic": "t"}, timeout=5).status_code == 401
        # 2 s: the default 200 ms can pass on a busy machine, and the client then decides
        # locally, without the report's window.
        with DetourClient(svc.url, decide_within=None, token=made["spark"][0],
                          timeout=2.0) as client:
            assert client.select("t").broker_name in {"x", "y"}
            client.report("x", 0, isolation=True)
            assert {client.select("t").broker_name for _ in range(4)} == {"y"}
        with DetourClient(svc.url, decide_within=None, token="wrong", timeout=2.0) as client, \
                pytest.raises(Exception) as err:
            client.select("t")
        assert "401" in str(err.value) or "UNAUTHORIZED" in str(err.value)


@pytest.mark.unit
def test_a_tokens_file_of_one_printed_entry_and_scrape_only_tokens() -> None:
    """`service.auth new` prints one entry: a file holding it alone is a tokens file. Tokens
    that only scrape (the metrics listener's) may all be for `*`; tokens that also say which
    namespaces a process serves may not."""
    entry = {"name": "prometheus", "sha256": hash_token("tok"), "role": "metrics",
             "namespace": "*"}
    with pytest.raises(ValueError, match="at least one token must name a namespace"):
        parse_tokens(json.dumps(entry), "x")
    table = parse_tokens(json.dumps(entry), "x", serves_namespaces=False)
    principal = table.lookup("tok")
    assert principal is not None and principal.scrape_namespaces() is None
    assert table.lookup("other") is None
    assert table.namespaces == []
