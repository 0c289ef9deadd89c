"""The Grafana dashboard and the Prometheus rules: their structure, promtool, and every
expression evaluated by a real Prometheus scraping a real Detour during a fault scenario."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from detour.model import DEFAULT_LATENCY_MAX
from service.app import create_app
from service.settings import Settings
from tests.asgi_client import TestClient
from tests.procs import (
    PATIENT_ENV,
    ROOT,
    HttpProcess,
    ServiceProcess,
    end_process,
    free_port,
    wait_until,
    write_tokens,
)

DASHBOARD = ROOT / "deploy" / "grafana" / "detour.json"
DASHBOARD_PROVIDER = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "detour.yaml"
DATASOURCE = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "rules.test.yaml"
EXAMPLE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTMANAGER_CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
DOC = ROOT / "docs" / "observability.md"

#: What Grafana would put in place of each dashboard variable. The rate window is wider
#: than Grafana's (4 x the 1 s scrape) so a slow CI machine still has samples in it.
RATE_WINDOW = "15s"
VARIABLES = {"__rate_interval": RATE_WINDOW, "job": ".*", "broker": ".*"}
SEVERITIES = {"critical", "warning", "info"}
#: Metric names in a PromQL expression (not functions, keywords or label names).
METRIC_NAME = re.compile(r"\b(detour_[a-z_]+|up)\b(?!\s*\()")


# ------------------------------------------------------------------------------ helpers
def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _targets() -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) for every query of the dashboard."""
    return [(p["title"], t["refId"], t["expr"])
            for p in _panels(_dashboard()) if p["type"] != "row" for t in p["targets"]]


def substitute(expr: str) -> str:
    """The expression as Grafana would send it, with every `$var` / `${var}` replaced."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in VARIABLES, f"unknown dashboard variable ${name} in {expr}"
        return VARIABLES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [r for g in doc["groups"] for r in g["rules"]]


def _alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for r in _rules() if "alert" in r}


def _binary(name: str, package: str = "prometheus") -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed: Debian package {package} (make system-deps)")
    return path


def _exported_families() -> dict[str, str]:
    """Every metric family GET /metrics declares (`# TYPE` lines), with its type."""
    with TestClient(create_app(Settings())) as client:
        client.put("/routes/t", json={"brokers": [{"brokerName": "a", "writeQueueNums": 1}]})
        client.post("/report-latency", json={"brokerName": "a", "latencyMs": 600})
        text = client.get("/metrics").text
    families = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            families[name] = kind
    return families


def _series_names(families: dict[str, str]) -> set[str]:
    """The sample names a query can use for those families."""
    names = set()
    for name, kind in families.items():
        names.add(name)
        if kind == "histogram":
            names.update(f"{name}_{s}" for s in ("bucket", "count", "sum"))
    return names


# ---------------------------------------------------------------------------- dashboard
@pytest.mark.unit
def test_dashboard_structure() -> None:
    d = _dashboard()
    assert d["uid"] == "detour-overview"
    assert d["title"] and d["description"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    job = variables["job"]
    assert job["type"] == "query" and re.fullmatch(r"label_values\(detour_\w+, job\)", job["query"])
    broker = variables["broker"]
    assert broker["type"] == "query"
    assert broker["query"] == "label_values(detour_broker_avoided, broker)"
    assert broker["multi"] is True and broker["includeAll"] is True
    assert broker["allValue"] == ".*"
    for var in (job, broker):
        assert var["datasource"] == {"type": "prometheus", "uid": "${datasource}"}

    panels = _panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert p.get("description", "").strip(), f"panel {p['title']!r} has no description"
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"]
            expr = t["expr"]
            assert expr.strip(), p["title"]
            # Every range is $__rate_interval, so rates follow the scrape interval.
            for window in re.findall(r"\[([^\]]*)\]", expr):
                assert window == "$__rate_interval", f"{p['title']}: [{window}] in {expr}"
            # Every selector is filtered by the job variable.
            for selector in re.findall(r"\b(?:detour_[a-z_]+|up)\b(\{[^}]*\})?", expr):
                assert 'job=~"$job"' in selector, f"{p['title']}: unfiltered selector in {expr}"


@pytest.mark.unit
def test_dashboard_has_the_required_panels() -> None:
    panels = [p for p in _panels(_dashboard()) if p["type"] != "row"]

    def find(kind: str | None, *fragments: str) -> dict[str, Any]:
        for p in panels:
            exprs = " ".join(t["expr"] for t in p["targets"])
            if (kind is None or p["type"] == kind) and all(f in exprs for f in fragments):
                return p
        raise AssertionError(f"no {kind or ''} panel querying {fragments}")

    find("timeseries", "sum by (decision) (rate(detour_selects_total")
    find(None, "detour_select_avoided_total", "/", "detour_selects_total")
    find("state-timeline", "detour_broker_avoided")
    heatmap = find("heatmap", "detour_reported_latency_seconds_bucket")
    assert heatmap["targets"][0]["format"] == "heatmap"
    for tier in ("50 ms", "100 ms", "550 ms", "1 s", "2 s", "3 s", "15 s"):
        assert tier in heatmap["description"], f"heatmap description lacks the {tier} tier"
    assert len(DEFAULT_LATENCY_MAX) == 7
    find(None, "detour_reports_total", 'outcome="isolation"')
    find(None, "detour_broker_available_in_seconds")
    find(None, "detour_route_all_avoided", "detour_routes_all_avoided")
    latency = find(None, "histogram_quantile(0.5", "histogram_quantile(0.99",
                   "detour_http_request_duration_seconds_bucket")
    assert all("by (route, le)" in t["expr"] for t in latency["targets"])
    find(None, "detour_store_errors_total")
    find(None, "detour_requests_shed_total")


@pytest.mark.unit
def test_grafana_provisioning() -> None:
    provider = yaml.safe_load(DASHBOARD_PROVIDER.read_text(encoding="utf-8"))
    assert provider["apiVersion"] == 1
    (p,) = provider["providers"]
    assert p["type"] == "file" and p["options"]["path"].startswith("/")
    datasources = yaml.safe_load(DATASOURCE.read_text(encoding="utf-8"))
    (ds,) = datasources["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    assert ds["isDefault"] is True


# -------------------------------------------------------------------------------- rules
@pytest.mark.unit
def test_every_alert_is_labelled_annotated_and_tested() -> None:
    alerts = _alerts()
    tests = yaml.safe_load(RULE_TESTS.read_text(encoding="utf-8"))
    fired: set[str] = set()
    silent: set[str] = set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert rule["annotations"]["summary"].strip(), name
        assert rule["annotations"]["description"].strip(), name
        assert name in fired, f"no promtool test sees {name} fire"
        assert name in silent, f"no promtool test sees {name} stay silent"
    assert (fired | silent) <= set(alerts), "tests name an alert that does not exist"


@pytest.mark.unit
def test_the_required_alerts_exist() -> None:
    by_expr = {r["expr"]: r for r in _alerts().values()}

    def find(*fragments: str) -> dict[str, Any]:
        for expr, rule in by_expr.items():
            if all(f in expr for f in fragments):
                return rule
        raise AssertionError(f"no alert on {fragments}")

    # Still avoided after 10 minutes: the page. An isolation: a ticket at once, naming
    # broker and reason (labels) and the window's end (the value).
    page = find("detour_broker_avoided{")
    assert page["for"] == "10m" and page["labels"]["severity"] == "critical"
    ticket = find("detour_isolation_windows_total", "detour_broker_available_in_seconds")
    assert ticket["labels"]["severity"] == "info" and "for" not in ticket
    assert "by (namespace, broker, reason)" in ticket["expr"]
    assert "$value | humanizeTimestamp" in ticket["annotations"]["summary"]
    find("detour_route_all_avoided")
    find("detour_store_errors_total")
    find("detour_requests_shed_total")
    select = find("histogram_quantile(0.99", 'route="/select"', "> 0.005")
    assert select["for"] == "10m"
    find("up{")


@pytest.mark.integration
def test_every_metric_the_artifacts_query_is_exported_and_documented() -> None:
    families = _exported_families()
    names = _series_names(families) | {"up", "ALERTS"}
    used = {m for _, _, e in _targets() for m in METRIC_NAME.findall(e)}
    used |= {m for r in _rules() for m in METRIC_NAME.findall(r["expr"])}
    assert used, "no metric found in the dashboard or the rules"
    assert used <= names, f"queried but not exported: {sorted(used - names)}"
    doc = DOC.read_text(encoding="utf-8")
    detour = sorted(n for n in families if n.startswith("detour_") and not n.endswith("_created"))
    missing = [n for n in detour if f"`{n}`" not in doc]
    assert not missing, f"docs/observability.md does not describe {missing}"


def sh_block(doc: str, after: str) -> str:
    """The first ```sh block of ``doc`` after the text ``after``."""
    assert after in doc, f"the doc lost {after!r}"
    m = re.search(r"```sh\n(.*?)```", doc.split(after, 1)[1], re.S)
    assert m, f"no sh block after {after!r}"
    return m.group(1)


def run_as_written(block: str, cwd: Path, timeout_s: float = 120) -> str:
    """A doc's shell block run by bash as it is (stop at the first failing command) in
    ``cwd``, which holds a copy of ``deploy/`` and the virtualenv; returns its output."""
    (cwd / ".venv").symlink_to(ROOT / ".venv")
    shutil.copytree(ROOT / "deploy", cwd / "deploy", symlinks=True)
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd,
                         capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, f"{block}\n-> {out.returncode}\n{out.stdout}{out.stderr}"
    return out.stdout + out.stderr


@pytest.mark.integration
def test_the_documented_checks_pass_as_written(tmp_path: Path) -> None:
    """docs/observability.md's block, word for word: make the scrape token where
    prometheus.yml reads it, then promtool (rules, unit tests, config) and amtool."""
    _binary("promtool")
    _binary("amtool", "prometheus-alertmanager")
    block = sh_block(DOC.read_text(encoding="utf-8"), "Check and test the rules")
    for command in ("promtool check rules deploy/prometheus/rules.yaml",
                    "promtool test rules deploy/prometheus/rules.test.yaml",
                    "promtool check config deploy/prometheus/prometheus.yml",
                    "amtool check-config deploy/alertmanager/alertmanager.yml"):
        assert command in block, command
    out = run_as_written(block, tmp_path)
    rules = len(_rules())
    assert out.count(f"SUCCESS: {rules} rules found") == 2, out  # check rules, check config
    assert "is valid prometheus config file syntax" in out and "FAILED" not in out, out
    assert f"{len(_inhibit_rules())} inhibit rules" in out, out
    # The token prometheus.yml names exists now, the token alone, for its owner only.
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
    (job,) = config["scrape_configs"]
    token = tmp_path / "deploy" / "prometheus" / job["authorization"]["credentials_file"]
    assert token.read_text().startswith("dtr_") and token.stat().st_mode & 0o777 == 0o600
    # ... and git keeps it out of the repository.
    assert "deploy/prometheus/detour-metrics-token" in \
        (ROOT / ".gitignore").read_text(encoding="utf-8").split()


@pytest.mark.integration
def test_promtool_unit_tests_of_the_rules() -> None:
    promtool = _binary("promtool")
    out = subprocess.run([promtool, "test", "rules", str(RULE_TESTS)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@pytest.mark.integration
def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    """Offline, through promtool's parser: each query becomes a recording rule."""
    promtool = _binary("promtool")
    targets = _targets()
    rules = [{"record": f"dashboard:query_{i}", "expr": substitute(e)}
             for i, (_, _, e) in enumerate(targets)]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    names = "\n".join(f"query_{i}: {title} / {ref}" for i, (title, ref, _) in enumerate(targets))
    assert out.returncode == 0, f"{out.stdout}{out.stderr}\n{names}"
    assert f"SUCCESS: {len(targets)} rules found" in out.stdout


# ------------------------------------------------------------------ Alertmanager
def _inhibit_rules() -> list[dict[str, Any]]:
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text(encoding="utf-8"))
    return config["inhibit_rules"]  # type: ignore[no-any-return]


def _matchers(matchers: list[str]) -> dict[str, str]:
    """``['alertname="X"']`` -> ``{"alertname": "X"}`` (equality matchers only)."""
    out = {}
    for m in matchers:
        match = re.fullmatch(r'(\w+)="([^"]*)"', m)
        assert match, f"only name=\"value\" matchers here: {m}"
        out[match.group(1)] = match.group(2)
    return out


def _promtool_expectations() -> Iterator[dict[str, dict[str, dict[str, str] | None]]]:
    """Per test case and eval time: {alertname: labels of its first expected alert, or None
    when it is expected silent}, the alertname included in the labels."""
    for case in yaml.safe_load(RULE_TESTS.read_text(encoding="utf-8"))["tests"]:
        by_time: dict[str, dict[str, dict[str, str] | None]] = {}
        for check in case.get("alert_rule_test", []):
            alerts = check.get("exp_alerts") or []
            labels = {**alerts[0]["exp_labels"], "alertname": check["alertname"]} \
                if alerts else None
            by_time.setdefault(str(check["eval_time"]), {})[check["alertname"]] = labels
        yield from by_time.values()


def _fired(source: str, target: str, together: bool) -> tuple[dict[str, str], dict[str, str]]:
    """The labels of ``source`` and ``target`` from a promtool case where both fire at once
    (``together``), or where ``target`` fires and ``source`` is expected silent."""
    for at in _promtool_expectations():
        if source in at and target in at and at[target] is not None \
                and (at[source] is not None) is together:
            return at[source] or {"alertname": source}, at[target]  # type: ignore[return-value]
    raise AssertionError(f"no promtool case with {target} firing and {source} "
                         f"{'firing' if together else 'silent'} at the same time")


@pytest.mark.unit
def test_each_inhibit_rule_mutes_an_alert_that_fires_with_its_source() -> None:
    """The rules the Alertmanager config inhibits fire together in the promtool tests, with
    the labels the rule matches on; and the muted one still fires on its own."""
    alerts = _alerts()
    rules = _inhibit_rules()
    pairs = set()
    for rule in rules:
        source = _matchers(rule["source_matchers"])["alertname"]
        target = _matchers(rule["target_matchers"])["alertname"]
        assert source in alerts and target in alerts, rule
        # The page that stays is at least as severe as the one it mutes.
        order = ["info", "warning", "critical"]
        assert order.index(alerts[source]["labels"]["severity"]) >= \
            order.index(alerts[target]["labels"]["severity"]), rule
        src, tgt = _fired(source, target, together=True)
        for label in rule["equal"]:
            assert src.get(label) == tgt.get(label), (rule, src, tgt)
        pairs.add((source, target))
    assert ("DetourRouteAllBrokersAvoided", "DetourRoutesAllAvoided") in pairs
    # Without its per-topic alert (a route beyond the 100 with a series), the total pages.
    _fired("DetourRouteAllBrokersAvoided", "DetourRoutesAllAvoided", together=False)


@pytest.mark.integration
def test_amtool_checks_the_alertmanager_config() -> None:
    amtool = _binary("amtool", "prometheus-alertmanager")
    out = subprocess.run([amtool, "check-config", str(ALERTMANAGER_CONFIG)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(_inhibit_rules())} inhibit rules" in out.stdout, out.stdout


def alertmanager(binary: str, workdir: Path, config: Path) -> HttpProcess:
    """A real Alertmanager on a free loopback port, clustering off."""
    port = free_port()
    return HttpProcess(
        "alertmanager",
        [binary, f"--config.file={config}", f"--storage.path={workdir / 'am'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
         "--log.level=warn"],
        port, None, workdir / "alertmanager.log", ready_path="/-/ready",
    )


@pytest.mark.e2e
def test_a_real_alertmanager_pages_once_per_incident(tmp_path: Path) -> None:
    """The label sets promtool expects, sent as Prometheus would: within one deployment
    (same ``cluster``) the muted alert is suppressed by its source; another deployment's,
    and the total firing alone, are not."""
    binary = shutil.which("prometheus-alertmanager") or _binary(
        "alertmanager", "prometheus-alertmanager")
    with alertmanager(binary, tmp_path, ALERTMANAGER_CONFIG) as am, \
            httpx.Client(base_url=am.url, timeout=5) as http:
        expected: dict[tuple[str, str], str] = {}  # (alertname, cluster) -> state
        posted = []
        for rule in _inhibit_rules():
            source = _matchers(rule["source_matchers"])["alertname"]
            target = _matchers(rule["target_matchers"])["alertname"]
            src, tgt = _fired(source, target, together=True)
            posted += [{**src, "cluster": "a"}, {**tgt, "cluster": "a"},
                       {**tgt, "cluster": "b"}]
            expected |= {(source, "a"): "active", (target, "a"): "suppressed",
                         (target, "b"): "active"}
        _, alone = _fired("DetourRouteAllBrokersAvoided", "DetourRoutesAllAvoided",
                          together=False)
        posted.append({**alone, "cluster": "c"})
        expected[("DetourRoutesAllAvoided", "c")] = "active"
        http.post("/api/v2/alerts", json=[{"labels": labels} for labels in posted]
                  ).raise_for_status()

        def states() -> dict[tuple[str, str], str]:
            alerts = http.get("/api/v2/alerts").json()
            return {(a["labels"]["alertname"], a["labels"]["cluster"]): a["status"]["state"]
                    for a in alerts}

        try:
            wait_until(lambda: states() == expected, 20, "the inhibitions", interval_s=0.1)
        except TimeoutError:
            log = (tmp_path / "alertmanager.log").read_text(errors="replace")[-2000:]
            raise AssertionError(f"{states()} != {expected}\n{log}") from None
        for a in http.get("/api/v2/alerts").json():
            if a["status"]["state"] == "suppressed":
                assert a["status"]["inhibitedBy"] and not a["status"]["silencedBy"], a


# ------------------------------------------------------------- a real Prometheus, live
class PrometheusServer:
    """``prometheus`` on a free loopback port, scraping one Detour every second."""

    def __init__(self, binary: str, workdir: Path, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "detour",
                                "authorization": {"type": "Bearer",
                                                  "credentials": SCRAPE_TOKEN},
                                "static_configs": [{"targets": [target]}]}],
        }
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
             "--log.level=warn"],
            stdout=self._log, stderr=self._log,
        )
        self.http = httpx.Client(base_url=self.url, timeout=5)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log()}")
            return self.http.get("/-/ready").status_code == 200

        try:
            wait_until(ready, 30, f"prometheus on {self.port}", interval_s=0.1)
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query; fails the test with Prometheus's own message on any error."""
        res = self.http.get("/api/v1/query", params={"query": expr})
        body = res.json()
        assert res.status_code == 200 and body["status"] == "success", (
            f"{expr}\n-> {res.status_code} {body.get('errorType')}: {body.get('error')}")
        assert body["data"]["resultType"] in ("vector", "scalar"), expr
        if body["data"]["resultType"] == "scalar":
            return [{"metric": {}, "value": body["data"]["result"]}]
        return body["data"]["result"]  # type: ignore[no-any-return]

    def values(self, expr: str, label: str | None = None) -> dict[str, float]:
        """{label value (or "") : sample value} of an instant query."""
        return {(r["metric"].get(label, "") if label else ""): float(r["value"][1])
                for r in self.query(expr)}

    def stop(self) -> None:
        end_process(self.proc)
        self.http.close()
        self._log.close()


@pytest.fixture
def prometheus_binary() -> str:
    return _binary("prometheus")


#: The live Detour runs with tokens: Prometheus scrapes with a metrics token, as deployed.
SCRAPE_TOKEN = "tok-scrape"
ADMIN = {"Authorization": "Bearer tok-admin"}


@pytest.fixture
def detour(redis_url: str, tmp_path: Path) -> Iterator[ServiceProcess]:
    tokens = write_tokens(tmp_path / "tokens.json", {
        "prometheus": (SCRAPE_TOKEN, "metrics", "*"), "ops": ("tok-admin", "admin", "default")})
    # Degraded only on purpose: a patient report timeout on a busy machine.
    svc = ServiceProcess(redis_url=redis_url,
                         env={**PATIENT_ENV, "DETOUR_TOKENS_FILE": str(tokens)})
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def prometheus(prometheus_binary: str, detour: ServiceProcess,
               tmp_path: Path) -> Iterator[PrometheusServer]:
    """Checked for first, so a machine without it skips before starting anything."""
    server = PrometheusServer(prometheus_binary, tmp_path, f"127.0.0.1:{detour.port}")
    try:
        yield server
    finally:
        server.stop()


def _eventually(prom: PrometheusServer, what: str, check: Any, timeout_s: float = 20) -> None:
    """Poll Prometheus (bounded) until ``check()`` holds: it scrapes and evaluates every 1 s."""
    try:
        wait_until(check, timeout_s, what, interval_s=0.2)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nprometheus log:\n{prom.log()}") from None


@pytest.mark.e2e
@pytest.mark.slow
def test_dashboard_and_rules_against_a_live_prometheus(
    prometheus: PrometheusServer, detour: ServiceProcess
) -> None:
    started = time.monotonic()
    prom = prometheus
    _eventually(prom, "first scrape of detour", lambda: prom.values('up{job="detour"}') ==
                {"": 1.0})

    with httpx.Client(base_url=detour.url, timeout=5, headers=ADMIN) as api:
        api.put("/routes/orders", json={"brokers": [
            {"brokerName": b, "writeQueueNums": 2} for b in ("a", "b", "c")
        ]}).raise_for_status()
        # a fails, b is slow (600 ms: the 550 ms tier, a 30 s window), c is healthy.
        for report in ({"brokerName": "a", "latencyMs": 3001, "isolation": True},
                       {"brokerName": "b", "latencyMs": 600},
                       {"brokerName": "c", "latencyMs": 20}):
            api.post("/report-latency", json=report).raise_for_status()
        for _ in range(20):
            assert api.post("/select", json={"topic": "orders"}).json()["brokerName"] == "c"
        _eventually(prom, "the new state scraped", lambda: prom.values(
            'detour_broker_avoided{job="detour"}', "broker") == {"a": 1, "b": 1, "c": 0})
        # Producers keep failing on a: a second isolation makes an increase rate() can see
        # (the series was born at 1 with the first one).
        api.post("/report-latency", json={"brokerName": "a", "latencyMs": 3001,
                                          "isolation": True}).raise_for_status()
        for _ in range(20):
            api.post("/select", json={"topic": "orders"}).raise_for_status()

        queries = _targets()
        by_title = {(title, ref): substitute(e) for title, ref, e in queries}
        isolations = by_title[("Isolations per broker", "A")]
        _eventually(prom, "the second isolation scraped",
                    lambda: prom.values(isolations, "broker").get("a", 0) > 0)

        # Every dashboard query evaluates; then the ones that tell the story.
        results = {key: prom.query(expr) for key, expr in by_title.items()}
        assert all(isinstance(r, list) for r in results.values())

        def vals(title: str, label: str | None = None, ref: str = "A") -> dict[str, float]:
            return {(r["metric"].get(label, "") if label else ""): float(r["value"][1])
                    for r in results[(title, ref)]}

        assert vals("Brokers avoided over time", "broker") == {"a": 1, "b": 1, "c": 0}
        assert vals("Brokers avoided now") == {"": 2}
        assert vals("Panic: routes with every broker avoided", "topic") == {"orders": 0}
        assert vals("Panic: routes with every broker avoided", ref="B") == {"": 0}
        assert vals("Routes with every broker avoided") == {"": 0}
        assert vals("Isolations per broker", "broker")["a"] > 0
        decisions = vals("Select rate by decision", "decision")
        assert decisions["available"] > 0 and decisions["pick_one_at_least"] == 0
        assert vals("Selects per second")[""] > 0
        ratio = vals("Avoidance ratio", "broker")
        assert 0 < ratio["a"] <= 1 and 0 < ratio["b"] <= 1 and "c" not in ratio
        assert vals("Avoidance ratio", ref="B") == {"": 0}
        assert 0 < vals("Avoidance ratio", ref="C")[""] <= 1
        returns = vals("Time until each avoided broker returns", "broker")
        assert set(returns) == {"a", "b"}
        assert 570 < returns["a"] <= 600 and 0 < returns["b"] <= 30
        latency = vals("Current latency per broker", "broker")
        assert latency["a"] == 3.001 and latency["b"] == 0.6
        # c's 20 ms changed no window, so a replica's copy (which the gauge reads) may not
        # have it yet: pushes carry window changes only.
        assert latency.get("c", 0.02) == 0.02
        heat = vals("Reported latency", "le")
        assert set(heat) >= {"0.05", "0.1", "0.55", "1.0", "3.0", "15.0", "+Inf"}
        assert vals("Avoidance") == {"": 1}
        assert vals("Replicas up") == {"": 1}
        p99 = vals("Endpoint latency p50 / p99", "route", ref="B")
        assert 0 < p99["/select"] < 1 and 0 < p99["/report-latency"] < 1
        # The series exist from the start (so rate() sees a first error) and stay at 0.
        assert set(vals("Store errors").values()) <= {0.0}
        assert set(vals("Shed rate").values()) <= {0.0}
        assert vals("Store degraded, per replica") == {"": 0}
        assert vals("Journal") == {"": 0}

        # The dashboard's variables resolve through the label API as Grafana asks them.
        for label, match, expected in (("job", "detour_avoidance_enabled", ["detour"]),
                                       ("broker", "detour_broker_avoided", ["a", "b", "c"])):
            res = prom.http.get(f"/api/v1/label/{label}/values", params={"match[]": match})
            assert res.json()["data"] == expected

        # Every rule loaded and evaluates without error; each expression also runs here.
        def rules_evaluated() -> bool:
            groups = prom.http.get("/api/v1/rules").json()["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            assert all(r["health"] != "err" for r in rules), rules
            return len(rules) == len(_rules()) and all(r["health"] == "ok" for r in rules)

        _eventually(prom, "every rule evaluated", rules_evaluated)
        alerts = _alerts()
        for rule in alerts.values():
            prom.query(rule["expr"])
        assert prom.values(alerts["DetourBrokerAvoidedTooLong"]["expr"], "broker") == {
            "a": 1, "b": 1}
        assert prom.values(alerts["DetourRouteAllBrokersAvoided"]["expr"]) == {}
        # Empty while Detour is up; awaited, since one scrape past its 1 s timeout on a busy
        # machine makes up 0 until the next.
        _eventually(prom, "DetourDown's expression empty",
                    lambda: prom.values(alerts["DetourDown"]["expr"]) == {})
        _eventually(prom, "avoided brokers pending", lambda: prom.values(
            'ALERTS{alertname="DetourBrokerAvoidedTooLong", alertstate="pending"}',
            "broker") == {"a": 1, "b": 1})
        # The ticket, firing at once (no `for`): a isolated by a failed send, b only slow.
        # Its value and text say until when: a's window end in the fault table.
        _eventually(prom, "DetourBrokerIsolated firing for a", lambda: prom.values(
            'ALERTS{alertname="DetourBrokerIsolated", alertstate="firing"}', "broker") == {
            "a": 1})
        (ticket,) = [a for a in prom.http.get("/api/v1/alerts").json()["data"]["alerts"]
                     if a["labels"]["alertname"] == "DetourBrokerIsolated"]
        assert {k: ticket["labels"][k] for k in ("broker", "reason", "severity", "namespace")} \
            == {"broker": "a", "reason": "isolation", "severity": "info", "namespace": "default"}
        items = {i["brokerName"]: i for i in api.get("/fault-items").json()["items"]}
        until = float(ticket["value"])
        assert abs(until - items["a"]["availableAt"] / 1000) < 2.5, (until, items["a"])
        shown = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(until))
        assert shown in ticket["annotations"]["summary"], ticket["annotations"]
        assert "A send to broker a failed" in ticket["annotations"]["description"]

        # c fails too: every broker of the route is avoided (panic) until the windows end.
        api.post("/report-latency", json={"brokerName": "c", "latencyMs": 0,
                                          "isolation": True}).raise_for_status()
        panic = by_title[("Panic: routes with every broker avoided", "A")]
        _eventually(prom, "panic scraped", lambda: prom.values(panic, "topic") == {"orders": 1})
        assert prom.values(by_title[("Panic: routes with every broker avoided", "B")]) == {"": 1}
        assert prom.values(alerts["DetourRouteAllBrokersAvoided"]["expr"], "topic") == {
            "orders": 1}
        _eventually(prom, "panic alert pending", lambda: prom.values(
            'ALERTS{alertname="DetourRouteAllBrokersAvoided", alertstate="pending"}',
            "topic") == {"orders": 1})
        for _ in range(10):
            assert api.post("/select", json={"topic": "orders"}).json()["decision"] == \
                "pick_one_at_least"
        pick = f'sum(rate(detour_selects_total{{decision="pick_one_at_least"}}[{RATE_WINDOW}]))'
        _eventually(prom, "pickOneAtLeast selects", lambda: prom.values(pick)[""] > 0)

    assert time.monotonic() - started < 60
