"""The image recipe and the Kubernetes manifests, checked without Docker or a cluster.

The Dockerfile is parsed (dockerfile-parse) and its properties asserted; the two locks are
checked against the dependency closures they pin (requirements.lock: the image's and
`make run`'s; requirements-dev.lock: the rest of `make test`'s).
Every kustomization is rendered with `kubectl kustomize`; every built-in object is validated
against the Kubernetes 1.30 schemas (kubernetes-validate, strict: unknown fields fail) and the
prometheus-operator objects, which it has no schema for, are checked field by field here.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from service.settings import Settings
from tests.procs import ROOT, ServiceProcess, end_process, free_port, wait_until

pytestmark = pytest.mark.integration

K8S_VERSION = "1.30.0"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
LOCK = ROOT / "requirements.lock"
DEV_LOCK = ROOT / "requirements-dev.lock"
PYPROJECT = ROOT / "pyproject.toml"
README = ROOT / "README.md"
DOC = ROOT / "docs" / "deploy.md"
DEPLOY = ROOT / "deploy"
SPARK_TEMPLATE = DEPLOY / "spark" / "executor-pod-template.yaml"
DASHBOARD = DEPLOY / "grafana" / "detour.json"
RULES = DEPLOY / "prometheus" / "rules.yaml"
#: Every kustomization a user applies (the base and the generators are in them).
KUSTOMIZATIONS = ["overlays/shared", "overlays/sidecar", "overlays/fanout", "observability"]
#: prometheus-operator kinds: no schema in kubernetes-validate, checked structurally.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "Pod"}
#: Above this, client-side `kubectl apply` cannot store the last-applied annotation.
LAST_APPLIED_LIMIT = 262_144


# ------------------------------------------------------------------------------ helpers
def _pyproject() -> dict[str, Any]:
    return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))


def _version() -> str:
    return str(_pyproject()["project"]["version"])


def _lock(path: Path = LOCK) -> dict[str, str]:
    """Canonical name -> pinned version; fails on any line that is not `name==version` (or,
    in the dev lock, its `-r requirements.lock`)."""
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if path == DEV_LOCK and line == "-r requirements.lock":
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line)
        assert m, f"{path.name}: not an exact pin: {line!r}"
        pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def _closure(requirements: list[str]) -> dict[str, set[str]]:
    """Every distribution `pip install <requirements>` installs on Linux, Python 3.11 (the
    image), with the extras asked of it; read from the installed metadata."""
    env = {
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "python_version": "3.11",
        "python_full_version": "3.11.7",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    todo = [Requirement(r) for r in requirements]
    seen: dict[str, set[str]] = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen and set(req.extras) <= seen[name]:
            continue  # walked already, with these extras
        extras = seen.setdefault(name, set())
        extras |= set(req.extras)
        for raw in metadata.requires(name) or []:
            sub = Requirement(raw)
            if sub.marker is not None and not any(
                sub.marker.evaluate({**env, "extra": e}) for e in ({""} | extras)
            ):
                continue
            todo.append(sub)
    return seen


def _runtime_closure() -> dict[str, set[str]]:
    """What the service needs at run time: the closure of [project].dependencies."""
    return _closure(_pyproject()["dependency-groups"]["server"])


def _stages(parser: DockerfileParser) -> list[list[dict[str, Any]]]:
    """The instructions of each stage, FROM first."""
    stages: list[list[dict[str, Any]]] = []
    for ins in parser.structure:
        if ins["instruction"] == "FROM":
            stages.append([])
        if stages and ins["instruction"] != "COMMENT":
            stages[-1].append(ins)
    return stages


def _dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(DOCKERFILE))


def _exec_form(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(x, str) for x in parsed), value
    return parsed


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a parent wins."""

    def regex(pattern: str) -> re.Pattern[str]:
        out = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**", i):
                out += ".*"
                i += 2
            elif pattern[i] == "*":
                out += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                out += "[^/]"
                i += 1
            else:
                out += re.escape(pattern[i])
                i += 1
        return re.compile(out)

    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        rx = regex(pattern)
        if any(rx.fullmatch(p) for p in prefixes):
            ignored = not negate
    return ignored


def _dockerignore() -> list[str]:
    return [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def _kustomize(path: Path) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl renders the manifests: `make system-deps` installs it"
    proc = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    docs = tuple(d for d in yaml.safe_load_all(proc.stdout) if d)
    assert docs, f"{path} rendered nothing"
    return docs


@cache
def _render(directory: str) -> tuple[dict[str, Any], ...]:
    """`kubectl kustomize deploy/<directory>`, as parsed objects."""
    return _kustomize(DEPLOY / directory)


def _spark_template() -> dict[str, Any]:
    return yaml.safe_load(SPARK_TEMPLATE.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _named_prefix(docs: tuple[dict[str, Any], ...], kind: str, prefix: str) -> dict[str, Any]:
    """A generated object, whose name has a content-hash suffix."""
    found = [
        d
        for d in docs
        if d["kind"] == kind
        and re.fullmatch(re.escape(prefix) + r"(-[a-z0-9]{10})?", d["metadata"]["name"])
    ]
    assert len(found) == 1, f"expected one {kind} {prefix}-<hash>, found {len(found)}"
    return found[0]


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def _containers(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    spec = _pod_spec(obj)
    for c in spec.get("initContainers", []):
        yield "init", c
    for c in spec["containers"]:
        yield "main", c


def _workloads() -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, object) for every workload of every kustomization and the Spark template."""
    for d in KUSTOMIZATIONS:
        for obj in _render(d):
            if obj["kind"] in WORKLOADS:
                yield f"{d}:{obj['kind']}/{obj['metadata']['name']}", obj
    yield "spark/executor-pod-template", _spark_template()


def _is_detour(container: dict[str, Any]) -> bool:
    return str(container.get("image", "")).split(":")[0].rsplit("/", 1)[-1] == "detour"


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _flag(args: list[str], name: str) -> str | None:
    for a in args:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


def _probe_target(probe: dict[str, Any]) -> str:
    """The path a probe asks for, whether httpGet or an exec'd request on loopback."""
    if "httpGet" in probe:
        return str(probe["httpGet"]["path"])
    command = " ".join(probe["exec"]["command"])
    m = re.search(r"/dev/tcp/127\.0\.0\.1/\d+\b.*\bGET (/\w+) HTTP/1\.0", command)
    assert m, f"exec probe asks no local Detour URL: {command}"
    return m.group(1)


def _options(args: list[str]) -> dict[str, list[list[str]]]:
    """redis-server's command line: each ``--option`` with its values, in order (an option
    may come more than once, as ``--user`` does)."""
    out: dict[str, list[list[str]]] = {}
    for arg in args:
        if arg.startswith("--"):
            out.setdefault(arg, []).append([])
            current = out[arg][-1]
        else:
            current.append(arg)
    return out


def _redis_option(args: list[str], name: str) -> str:
    """The one value of a single-valued option."""
    (values,) = _options(args)[name]
    (value,) = values
    return value


# ----------------------------------------------------------------------------- Dockerfile
def test_dockerfile_is_multi_stage_slim_and_runs_as_non_root() -> None:
    parser = _dockerfile()
    stages = _stages(parser)
    assert len(stages) >= 2, "multi-stage: a build stage and a final stage"
    args = {
        i["value"].split("=", 1)[0]: i["value"].split("=", 1)[1]
        for i in parser.structure
        if i["instruction"] == "ARG" and "=" in i["value"]
    }
    for stage in stages:
        base = stage[0]["value"].split()[0]
        base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", base), f"not a slim Python: {base}"
    final = stages[-1]
    users = [i["value"] for i in final if i["instruction"] == "USER"]
    assert users, "the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER must be a numeric non-root uid, got {users[-1]}"
    # The final stage installs nothing: no compiler, no package manager run, no pip.
    for ins in final:
        if ins["instruction"] == "RUN":
            assert not re.search(
                r"\b(apt-get|apt|apk|pip|gcc|make|build-essential)\b", ins["value"]
            ), f"final stage installs or builds: {ins['value']}"
    copies = [i["value"] for i in final if i["instruction"] == "COPY"]
    assert copies and all(c.startswith("--from=") for c in copies), (
        "the final stage takes everything from the build stage"
    )


def test_dockerfile_installs_the_runtime_lock_only() -> None:
    build_runs = " ".join(
        i["value"] for i in _stages(_dockerfile())[0] if i["instruction"] == "RUN"
    )
    assert re.search(r"pip install [^&]*-r \S*/requirements\.lock(\s|$)", build_runs)
    instructions = " ".join(i["value"] for i in _dockerfile().structure
                            if i["instruction"] != "COMMENT")
    assert "requirements-dev" not in instructions
    assert "--only-binary=:all:" in build_runs, "wheels only: no compiler in the build"
    assert "pip check" in build_runs


def test_the_runtime_lock_pins_exactly_what_the_service_needs_at_run_time() -> None:
    pins = _lock()
    closure = _runtime_closure()
    assert set(pins) == set(closure), (
        f"pinned, not needed: {sorted(set(pins) - set(closure))}; "
        f"needed, not pinned: {sorted(set(closure) - set(pins))}"
    )
    for name in closure:
        installed = metadata.version(name)
        assert installed == pins[name], f"{name}: lock {pins[name]}, environment {installed}"
    for raw in _pyproject()["dependency-groups"]["server"]:
        req = Requirement(raw)
        assert SpecifierSet(str(req.specifier)).contains(pins[canonicalize_name(req.name)]), (
            f"the lock's {req.name}=={pins[canonicalize_name(req.name)]} is outside {raw}"
        )
    # Sanity of the walk itself: extras were followed.
    assert {"uvloop", "httptools", "hiredis", "starlette", "pydantic-core"} <= set(closure)


def test_the_dev_lock_pins_the_rest_of_make_test_on_top_of_the_runtime_lock() -> None:
    lines = [ln for ln in DEV_LOCK.read_text(encoding="utf-8").splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "-r requirements.lock", "pip install -r requirements-dev.lock: everything"
    runtime, dev = _lock(), _lock(DEV_LOCK)
    assert not set(runtime) & set(dev), "a package pinned in both locks"
    groups = _pyproject()["dependency-groups"]
    closure = _closure([r for name in ("dev", "pipeline") for r in groups[name]])
    needed = set(closure) - set(runtime)
    assert set(dev) == needed, (
        f"pinned, not needed: {sorted(set(dev) - needed)}; "
        f"needed, not pinned: {sorted(needed - set(dev))}"
    )
    for name, version in dev.items():
        assert metadata.version(name) == version, f"{name}: lock {version}"
    # The dev, test and Spark packages stay out of the image and `make run`.
    for name in ("pytest", "pyspark", "selenium", "ruff", "mypy", "schemathesis", "matplotlib"):
        assert name in dev and name not in runtime, name


def test_dockerfile_entrypoint_is_the_documented_command() -> None:
    parser = _dockerfile()
    final = _stages(parser)[-1]
    (entrypoint,) = [i["value"] for i in final if i["instruction"] == "ENTRYPOINT"]
    command = _exec_form(entrypoint)  # exec form: Python is PID 1 and gets SIGTERM
    assert command == ["python", "-m", "service"]
    assert "python -m service" in README.read_text(encoding="utf-8")
    assert "ENV" in {i["instruction"] for i in final}
    envs = parser.envs
    assert envs["PATH"].startswith("/opt/venv/bin:"), "`python` must be the venv's"
    default_port = Settings.model_fields["port"].default
    assert envs["DETOUR_PORT"] == str(default_port)
    assert envs["DETOUR_HOST"] == "0.0.0.0", "a container must listen beyond its loopback"
    exposed = [i["value"] for i in final if i["instruction"] == "EXPOSE"]
    assert exposed == [str(default_port)]


def test_dockerfile_healthcheck_and_oci_labels() -> None:
    parser = _dockerfile()
    final = _stages(parser)[-1]
    (health,) = [i["value"] for i in final if i["instruction"] == "HEALTHCHECK"]
    m = re.search(r"\bCMD\s+(\[.*\])\s*$", health)
    assert m, f"HEALTHCHECK without an exec-form CMD: {health}"
    check = _exec_form(m.group(1))
    assert check[0] == "python" and "/healthz" in " ".join(check)
    labels = parser.labels
    project = _pyproject()["project"]
    for key in ("title", "description", "version", "revision", "source", "licenses"):
        assert f"org.opencontainers.image.{key}" in labels, key
    assert labels["org.opencontainers.image.version"] == project["version"]
    assert labels["org.opencontainers.image.licenses"] == project["license"]
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").lstrip().startswith("Apache License")


def test_dockerignore_sends_only_what_the_build_copies() -> None:
    patterns = _dockerignore()
    assert patterns[0] == "*", "an allow-list: ignore everything, then re-include"
    sources = []
    for stage in _stages(_dockerfile()):
        for ins in stage:
            if ins["instruction"] == "COPY" and not ins["value"].startswith("--from="):
                sources.extend(ins["value"].split()[:-1])
    assert sources
    for src in sources:
        target = ROOT / src
        assert target.exists(), f"COPY {src}: no such path"
        probe = next(p for p in sorted(target.rglob("*.py"))) if target.is_dir() else target
        rel = probe.relative_to(ROOT).as_posix()
        assert not _ignored(rel, patterns), f"{rel} is copied but .dockerignore drops it"
    for kept_out in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/test_deploy.py",
        "bench/run.py",
        "deploy/base/kustomization.yaml",
        "service/__pycache__/app.cpython-311.pyc",
        ".env",
        "pipeline/produce.py",
        "requirements-dev.lock",
        "pyproject.toml",
    ):
        assert _ignored(kept_out, patterns), f"{kept_out} would reach the build context"
    assert not _ignored("service/store/lua/report.lua", patterns)
    assert not _ignored("service/static/status.html", patterns)


# ------------------------------------------------------------------------- schemas (1.30)
@pytest.mark.parametrize("where", [*KUSTOMIZATIONS, "base", "spark"])
def test_every_object_is_valid_for_kubernetes_1_30(where: str) -> None:
    docs = (_spark_template(),) if where == "spark" else _render(where)
    builtin = 0
    for obj in docs:
        ident = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        if (obj.get("apiVersion"), obj.get("kind")) in CRD_KINDS:
            _check_crd_object(obj)
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {ident}: {exc.message} at {list(exc.path)}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{where}: {ident}: {exc.message}")
        builtin += 1
    assert builtin, f"{where}: nothing validated"


def _check_crd_object(obj: dict[str, Any]) -> None:
    """What the prometheus-operator CRDs require, and the fields Detour relies on."""
    meta = obj["metadata"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"]), meta["name"]
    spec = obj["spec"]
    if obj["kind"] == "ServiceMonitor":
        assert set(spec) <= {
            "jobLabel",
            "selector",
            "endpoints",
            "namespaceSelector",
            "targetLabels",
            "podTargetLabels",
            "sampleLimit",
        }, set(spec)
        assert spec["selector"]["matchLabels"], "a ServiceMonitor without a selector scrapes all"
        assert spec["endpoints"]
        for ep in spec["endpoints"]:
            assert isinstance(ep["port"], str) and ep["path"].startswith("/")
            for key in ("interval", "scrapeTimeout"):
                assert re.fullmatch(r"\d+(ms|s|m|h)", ep[key]), ep
    elif obj["kind"] == "PodMonitor":
        assert set(spec) <= {
            "jobLabel",
            "selector",
            "podMetricsEndpoints",
            "namespaceSelector",
            "podTargetLabels",
            "sampleLimit",
        }, set(spec)
        assert spec["selector"]["matchLabels"], "a PodMonitor without a selector scrapes all"
        assert spec["podMetricsEndpoints"]
        for ep in spec["podMetricsEndpoints"]:
            assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "authorization",
                               "relabelings", "metricRelabelings", "scheme"}, set(ep)
            assert isinstance(ep["port"], str) and ep["path"].startswith("/")
            for key in ("interval", "scrapeTimeout"):
                assert re.fullmatch(r"\d+(ms|s|m|h)", ep[key]), ep
            for r in ep.get("relabelings", []):
                assert set(r) <= {"sourceLabels", "targetLabel", "replacement", "regex",
                                  "action", "separator"}, r
    else:
        groups = spec["groups"]
        assert groups and all(g["name"] and g["rules"] for g in groups)


# ------------------------------------------------------------------------------ invariants
def test_every_container_is_non_root_read_only_and_bounded() -> None:
    seen = 0
    for where, obj in _workloads():
        pod = _pod_spec(obj)
        pod_ctx = pod.get("securityContext", {})
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for _, c in _containers(obj):
            if where.startswith("spark") and c["name"] == "spark-executor":
                continue  # Spark fills the executor in
            seen += 1
            ident = f"{where} container {c['name']}"
            ctx = c.get("securityContext", {})
            assert ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True, ident
            uid = ctx.get("runAsUser", pod_ctx.get("runAsUser"))
            assert isinstance(uid, int) and uid > 0, f"{ident}: numeric non-root uid"
            assert ctx.get("readOnlyRootFilesystem") is True, ident
            assert ctx.get("allowPrivilegeEscalation") is False, ident
            assert ctx.get("capabilities", {}).get("drop") == ["ALL"], ident
            res = c.get("resources", {})
            assert {"cpu", "memory"} <= set(res.get("requests", {})), f"{ident}: requests"
            assert "memory" in res.get("limits", {}), f"{ident}: memory limit"
            # A read-only root needs somewhere to write: /tmp on an emptyDir.
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts, f"{ident}: no writable /tmp"
            assert "emptyDir" in volumes[mounts["/tmp"]], f"{ident}: /tmp is not an emptyDir"
    assert seen >= 5


def test_every_detour_container_has_probes_and_a_writable_metrics_dir() -> None:
    detours = 0
    for where, obj in _workloads():
        volumes = {v["name"]: v for v in _pod_spec(obj).get("volumes", [])}
        for role, c in _containers(obj):
            if not _is_detour(c):
                continue
            detours += 1
            ident = f"{where} container {c['name']}"
            if not where.startswith("spark"):
                assert c["image"] == f"detour:{_version()}", f"{ident}: {c['image']}"
            assert _probe_target(c["startupProbe"]) == "/readyz", ident
            assert _probe_target(c["readinessProbe"]) == "/readyz", ident
            assert _probe_target(c["livenessProbe"]) == "/healthz", ident
            args = c.get("args", [])
            if role == "init":
                # A native sidecar: started first, kept running, stopped after the main one.
                assert c.get("restartPolicy") == "Always", f"{ident}: not a native sidecar"
                assert _flag(args, "host") == "127.0.0.1", f"{ident}: must stay on loopback"
                assert "DETOUR_TOKENS_FILE" not in _env(c), ident
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    # The kubelet's httpGet goes to the pod IP, where a loopback Detour
                    # does not listen.
                    assert "exec" in c[probe], f"{ident}: {probe} must be exec"
            else:
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert c[probe]["httpGet"]["port"] == "http", ident
            # prometheus-client's multiprocess files: the env var, if set, must be a mount.
            multiproc = _env(c).get("PROMETHEUS_MULTIPROC_DIR", {}).get("value")
            if multiproc:
                mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
                assert multiproc in mounts and "emptyDir" in volumes[mounts[multiproc]], ident
            assert "DETOUR_REDIS_URL" in _env(c) or role == "main", ident
    assert detours >= 4  # shared, sidecar overlay's central one and its sidecar, Spark


def test_shared_overlay_is_one_autoscaled_service_on_redis() -> None:
    docs = _render("overlays/shared")
    assert {d["metadata"].get("namespace") for d in docs} == {"detour"}
    deploy = _one(docs, "Deployment", "detour")
    # The autoscaler owns the count; a manifest count would be reset by every apply.
    assert "replicas" not in deploy["spec"]
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    hpa = _one(docs, "HorizontalPodAutoscaler", "detour")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "detour",
    }
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert "cpu" in container["resources"]["requests"], "HPA utilisation needs a CPU request"
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    selector = deploy["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()

    pdb = _one(docs, "PodDisruptionBudget", "detour")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]

    # The Service reaches the container port, and is named as the alert rules' job.
    service = _one(docs, "Service", "detour")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (sport,) = service["spec"]["ports"]
    assert sport["targetPort"] in ports
    assert 'job="detour"' in RULES.read_text(encoding="utf-8")

    # Configuration: listen on the pod IP at the container port; tokens from a Secret file.
    (config_ref,) = [e["configMapRef"]["name"] for e in container["envFrom"]]
    config = _one(docs, "ConfigMap", config_ref)["data"]
    assert config_ref.startswith("detour-config-"), "generated: a change rolls the pods"
    assert config["DETOUR_HOST"] == "0.0.0.0"
    assert int(config["DETOUR_PORT"]) == ports[sport["targetPort"]]
    assert config["DETOUR_WORKERS"] == "1"
    Settings.model_validate(
        {
            k.removeprefix("DETOUR_").lower(): v
            for k, v in config.items()
            if k != "DETOUR_TOKENS_FILE"
        }
    )
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    tokens = volumes["tokens"]["secret"]
    assert tokens["secretName"] == "detour-tokens" and not tokens.get("optional", False)
    tokens_file = Path(mounts["tokens"]["mountPath"]) / tokens["items"][0]["path"]
    assert config["DETOUR_TOKENS_FILE"] == str(tokens_file)
    assert mounts["tokens"]["readOnly"] is True

    # DETOUR_REDIS_URL comes from the generated Secret and names the bundled Redis Service,
    # as an ACL user and without a password (that is in a file: the next test).
    ref = _env(container)["DETOUR_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    secret = _one(docs, "Secret", ref["name"])
    url = base64.b64decode(secret["data"][ref["key"]]).decode()
    m = re.fullmatch(r"redis://detour@([a-z0-9-]+):(\d+)/\d+", url)
    assert m, url
    redis_service = _one(docs, "Service", m.group(1))
    assert int(m.group(2)) in {p["port"] for p in redis_service["spec"]["ports"]}
    # Shutdown: the grace period covers the preStop pause and Detour's own drain.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    grace = deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert pre_stop[0] == "sleep"
    assert int(pre_stop[1]) + int(config["DETOUR_SHUTDOWN_GRACE_S"]) < grace


def test_one_cpu_request_for_a_shared_replica() -> None:
    """The base, the shared overlay, the sidecar overlay's central replica and the chart
    request one figure, the one the autoscaler's target and docs/deploy.md are based on."""
    requests = {}
    for where in ("base", "overlays/shared", "overlays/sidecar"):
        (container,) = _one(_render(where), "Deployment", "detour")["spec"]["template"][
            "spec"]["containers"]
        requests[where] = container["resources"]["requests"]["cpu"]
    chart = yaml.safe_load((ROOT / "helm/detour/values.yaml").read_text(encoding="utf-8"))
    requests["chart"] = chart["resources"]["requests"]["cpu"]
    assert set(requests.values()) == {"500m"}, requests
    hpa = _one(_render("overlays/shared"), "HorizontalPodAutoscaler", "detour")
    target = hpa["spec"]["metrics"][0]["resource"]["target"]["averageUtilization"]
    assert target == chart["autoscaling"]["targetCPUUtilizationPercentage"] == 70
    sizing = DOC.read_text(encoding="utf-8").split("\n## Sizing", 1)[1].split("\n## ", 1)[0]
    assert "500m" in sizing and "250m" not in DOC.read_text(encoding="utf-8")


def test_redis_keeps_the_table_on_a_volume_with_aof() -> None:
    docs = _render("overlays/shared")
    sts = _one(docs, "StatefulSet", "detour-redis")
    (redis,) = sts["spec"]["template"]["spec"]["containers"]
    args = redis["args"]
    assert _redis_option(args, "--appendonly") == "yes"
    assert _redis_option(args, "--appendfsync") == "everysec"
    assert _redis_option(args, "--maxmemory-policy") == "noeviction", \
        "an evicted fault item readmits a broker"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in redis["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == _redis_option(args, "--dir")
    assert claim["spec"]["resources"]["requests"]["storage"]
    headless = _one(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert redis[probe]["exec"]["command"] == ["redis-cli", "ping"]


def _setting(docs: tuple[dict[str, Any], ...], container: dict[str, Any], name: str) -> str | None:
    """A DETOUR_* setting as the container sees it: its env, else its envFrom ConfigMaps."""
    if name in _env(container):
        return str(_env(container)[name]["value"])
    for source in container.get("envFrom", []):
        data = _one(docs, "ConfigMap", source["configMapRef"]["name"])["data"]
        if name in data:
            return str(data[name])
    return None


def test_redis_requires_a_password_every_detour_reads_from_a_file() -> None:
    """The bundled Redis's ACL users take their password from one Secret key; every Detour
    container (central, sidecar, Spark executor's) mounts that key where
    DETOUR_REDIS_PASSWORD_FILE points, and connects as the ACL user."""
    spark = _spark_template()
    for overlay in ("overlays/shared", "overlays/sidecar"):
        docs = _render(overlay)
        sts = _one(docs, "StatefulSet", "detour-redis")
        (redis,) = sts["spec"]["template"]["spec"]["containers"]
        ref = _env(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        users = {values[0]: values[1:] for values in _options(redis["args"])["--user"]}
        # Anyone without the password may only PING (the probes); Detour's user touches
        # only Detour's keys and channels, and no admin or dangerous command.
        assert users["default"] == ["on", "nopass", "-@all", "+ping"], users
        assert users["detour"] == ["on", ">$(REDIS_PASSWORD)", "~detour:*", "&detour:*",
                                   "+@all", "-@admin", "-@dangerous"], users
        assert set(users) == {"default", "detour"}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert redis[probe]["exec"]["command"] == ["redis-cli", "ping"]
        pods = [obj for obj in docs if obj["kind"] in WORKLOADS] + [spark]
        seen = 0
        for obj in pods:
            volumes = {v["name"]: v for v in _pod_spec(obj).get("volumes", [])}
            for _, c in _containers(obj):
                if not _is_detour(c):
                    continue
                seen += 1
                ident = f"{overlay}: {obj['kind']}/{obj['metadata'].get('name')} {c['name']}"
                path = _setting(docs, c, "DETOUR_REDIS_PASSWORD_FILE")
                assert path, f"{ident}: no DETOUR_REDIS_PASSWORD_FILE"
                mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
                assert mount["readOnly"] is True, ident
                secret = volumes[mount["name"]]["secret"]
                assert secret["secretName"] == ref["name"] and not secret.get("optional"), ident
                assert secret["items"] == [{"key": ref["key"],
                                            "path": path.removeprefix(mount["mountPath"] + "/")}]
                url_ref = _env(c)["DETOUR_REDIS_URL"]["valueFrom"]["secretKeyRef"]
                if obj is not spark:
                    url = _one(docs, "Secret", url_ref["name"])["data"][url_ref["key"]]
                    assert base64.b64decode(url).decode().startswith("redis://detour@"), ident
        assert seen >= 2


def test_network_policies_let_only_detour_reach_redis() -> None:
    """Redis admits port 6379 from pods labelled detour-redis-client=true (here, or in a
    namespace labelled so); exactly the pods running Detour carry the label; Detour's own
    pods admit their HTTP port and nothing else."""
    for overlay in ("overlays/shared", "overlays/sidecar"):
        docs = _render(overlay)
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        sts = _one(docs, "StatefulSet", "detour-redis")
        redis_labels = sts["spec"]["template"]["metadata"]["labels"]

        def selecting(labels: dict[str, str],
                      policies: list[dict[str, Any]] = policies) -> list[dict[str, Any]]:
            return [p for p in policies
                    if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]

        (redis_policy,) = selecting(redis_labels)
        assert redis_policy["spec"]["policyTypes"] == ["Ingress"]
        (rule,) = redis_policy["spec"]["ingress"]
        assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
        for peer in rule["from"]:
            assert peer["podSelector"]["matchLabels"] == {"detour-redis-client": "true"}, peer
            if "namespaceSelector" in peer:  # never every namespace
                assert peer["namespaceSelector"]["matchLabels"] == {"detour-redis-client": "true"}
        workloads = [d for d in docs if d["kind"] in WORKLOADS and d is not sts]
        for obj in [*workloads, _spark_template()]:
            labels = (obj["metadata"] if obj["kind"] == "Pod"
                      else obj["spec"]["template"]["metadata"]).get("labels", {})
            runs_detour = any(_is_detour(c) for _, c in _containers(obj))
            assert (labels.get("detour-redis-client") == "true") == runs_detour, obj["metadata"]

        deploy = _one(docs, "Deployment", "detour")
        (detour_policy,) = selecting(deploy["spec"]["template"]["metadata"]["labels"])
        (container,) = deploy["spec"]["template"]["spec"]["containers"]
        (rule,) = detour_policy["spec"]["ingress"]
        assert rule["ports"] == [{"port": p["containerPort"], "protocol": "TCP"}
                                 for p in container["ports"]]
        assert rule["from"] == [{"namespaceSelector": {}}]  # the cluster, not the world


def _sidecar_probes() -> dict[str, list[str]]:
    """Every exec probe of a Detour sidecar (the overlay's and the Spark template's)."""
    out = {}
    producer = _one(_render("overlays/sidecar"), "Deployment", "example-producer")
    for where, obj in (("sidecar", producer), ("spark", _spark_template())):
        for role, c in _containers(obj):
            if role == "init" and _is_detour(c):
                for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                    out[f"{where} {kind}"] = c[kind]["exec"]["command"]
    return out


@pytest.mark.e2e
def test_the_sidecar_probes_say_what_the_kubelet_needs(tmp_path: Path) -> None:
    """The manifests' exec probes, run as the kubelet would (on the port a test Detour has):
    0 from a ready Detour; the readiness probes fail on one that is alive but has no table
    yet while liveness passes; all fail, at once, where nothing listens."""
    probes = _sidecar_probes()
    assert len(probes) == 6
    port_in_probe = re.compile(r"/dev/tcp/127\.0\.0\.1/8080\b")

    def run(command: list[str], port: int) -> int:
        argv = [port_in_probe.sub(f"/dev/tcp/127.0.0.1/{port}", a) for a in command]
        assert argv != command, "the probe names no port to replace"
        started = time.monotonic()
        rc = subprocess.run(argv, capture_output=True, timeout=10).returncode
        assert time.monotonic() - started < 3, "slower than the probes' timeoutSeconds"
        return rc

    with ServiceProcess() as ready:
        assert {name: run(cmd, ready.port) for name, cmd in probes.items()} == \
            dict.fromkeys(probes, 0)
    # Alive, not ready: its Redis does not answer, so no table was ever synced.
    port = free_port()
    unready = subprocess.Popen(
        [sys.executable, "-m", "service", "--port", str(port), "--redis-url",
         f"redis://127.0.0.1:{free_port()}/0"], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
                   .status_code == 200, 30, "detour without redis")
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 503
        rcs = {name: run(cmd, port) for name, cmd in probes.items()}
        assert {n: rc == 0 for n, rc in rcs.items()} == {
            n: n.endswith("livenessProbe") for n in probes}, rcs
    finally:
        end_process(unready)
    nobody = free_port()
    assert all(run(cmd, nobody) != 0 for cmd in probes.values())


def test_redis_is_not_evicted_by_drains() -> None:
    docs = _render("overlays/shared")
    sts = _one(docs, "StatefulSet", "detour-redis")
    pdb = _one(docs, "PodDisruptionBudget", "detour-redis")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= \
        sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["replicas"] == 1 and pdb["spec"]["maxUnavailable"] == 0


def test_sidecar_overlay_puts_detour_beside_the_producer() -> None:
    docs = _render("overlays/sidecar")
    producer = _one(docs, "Deployment", "example-producer")
    spec = producer["spec"]["template"]["spec"]
    (sidecar,) = spec["initContainers"]
    assert _is_detour(sidecar) and sidecar["restartPolicy"] == "Always"
    port = _flag(sidecar["args"], "port")
    (main,) = spec["containers"]
    assert _env(main)["DETOUR_URL"]["value"] == f"http://127.0.0.1:{port}"
    # The sidecar shares the table: the same generated Secret as the central replica.
    ref = _env(sidecar)["DETOUR_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    secret = _named_prefix(docs, "Secret", "detour-redis")
    assert ref["name"] == secret["metadata"]["name"]
    central = _one(docs, "Deployment", "detour")
    assert central["spec"]["replicas"] == 1
    central_ref = _env(central["spec"]["template"]["spec"]["containers"][0])["DETOUR_REDIS_URL"]
    assert central_ref["valueFrom"]["secretKeyRef"] == ref
    assert _one(docs, "StatefulSet", "detour-redis")


def test_sidecar_metrics_are_scraped_on_the_pod_ip_with_a_token() -> None:
    """The sidecar's metrics listener: on the pod IP (the main listener stays on loopback),
    its port named as the PodMonitor scrapes it, the PodMonitor selecting exactly the
    producer pods, with the Secret's token, as job="detour"; the sidecar mounts only the
    token's digest entry, from the same Secret."""
    docs = _render("overlays/sidecar")
    producer = _one(docs, "Deployment", "example-producer")
    pod = producer["spec"]["template"]
    (sidecar,) = pod["spec"]["initContainers"]
    env = _env(sidecar)
    assert _flag(sidecar["args"], "host") == "127.0.0.1"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["DETOUR_METRICS_HOST"]["value"] == "$(POD_IP)"
    names = [e["name"] for e in sidecar["env"]]
    assert names.index("POD_IP") < names.index("DETOUR_METRICS_HOST"), "$(POD_IP) expands"
    (port,) = sidecar["ports"]
    assert port["containerPort"] == int(env["DETOUR_METRICS_PORT"]["value"])
    assert port["containerPort"] != int(_flag(sidecar["args"], "port") or 0)
    Settings.model_validate({"metrics_host": "10.0.0.7",
                             "metrics_port": env["DETOUR_METRICS_PORT"]["value"]})

    monitor = _one(docs, "PodMonitor", "detour-sidecars")
    assert monitor["metadata"]["namespace"] == producer["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    central = _one(docs, "Deployment", "detour")["spec"]["template"]["metadata"]["labels"]
    assert not monitor["spec"]["selector"]["matchLabels"].items() <= central.items()
    (ep,) = monitor["spec"]["podMetricsEndpoints"]
    assert ep["port"] == port["name"] and ep["path"] == "/metrics"
    assert {"targetLabel": "job", "replacement": "detour"} in ep["relabelings"]
    assert 'job="detour"' in RULES.read_text(encoding="utf-8")
    # One Secret: Prometheus reads its `token`, the sidecar mounts only `tokens.yaml` (the
    # digest entry), where DETOUR_METRICS_TOKENS_FILE points.
    secret = ep["authorization"]["credentials"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    (vol,) = [v for v in volumes.values()
              if v.get("secret", {}).get("secretName") == secret["name"]]
    (item,) = vol["secret"]["items"]
    assert item["key"] != secret["key"] and not vol["secret"].get("optional", False)
    assert mounts[vol["name"]]["readOnly"] is True
    path = Path(mounts[vol["name"]]["mountPath"]) / item["path"]
    assert env["DETOUR_METRICS_TOKENS_FILE"]["value"] == str(path)
    # The ServiceMonitor of the shared service reads the same Secret's token.
    service_monitor = _one(_render("observability"), "ServiceMonitor", "detour")
    (sm_ep,) = service_monitor["spec"]["endpoints"]
    assert sm_ep["authorization"]["credentials"] == secret


def test_observability_configmaps_are_the_repository_files() -> None:
    docs = _render("observability")
    dashboard = _one(docs, "ConfigMap", "detour-grafana-dashboard")
    assert dashboard["data"] == {"detour.json": DASHBOARD.read_text(encoding="utf-8")}
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    rules = _one(docs, "ConfigMap", "detour-prometheus-rules")
    assert rules["data"] == {"rules.yaml": RULES.read_text(encoding="utf-8")}
    for cm in (dashboard, rules):
        assert len(json.dumps(cm)) < LAST_APPLIED_LIMIT, cm["metadata"]["name"]

    # The ServiceMonitor finds the shared Service, its port by name, and yields job="detour".
    monitor = _one(docs, "ServiceMonitor", "detour")
    service = _one(_render("overlays/shared"), "Service", "detour")
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert {ep["port"] for ep in monitor["spec"]["endpoints"]} <= port_names
    assert labels[monitor["spec"]["jobLabel"]] == "detour"
    for ep in monitor["spec"]["endpoints"]:
        assert ep["path"] == "/metrics"
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]


# ------------------------------------------------------------------------------------ docs
def test_readme_and_deploy_doc_point_at_what_exists() -> None:
    readme = README.read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", readme, flags=re.M)
    assert "Deploying" in headings
    if "Development" in headings:
        assert headings.index("Deploying") < headings.index("Development")
    section = readme.split("## Deploying", 1)[1].split("\n## ", 1)[0]
    assert "docs/deploy.md" in section
    assert "helm lint" in section and "helm template" in section
    doc = DOC.read_text(encoding="utf-8")
    paths = set(re.findall(r"\b((?:deploy|helm)/[\w./-]*[\w/])", doc))
    assert {"deploy/overlays/shared", "deploy/overlays/sidecar", "helm/detour"} <= {
        p.rstrip("/") for p in paths
    }
    for p in paths:
        assert (ROOT / p).exists(), f"docs/deploy.md names {p}, which does not exist"
    # The in-cluster URL the doc gives is the Service's.
    service = _one(_render("overlays/shared"), "Service", "detour")
    ns, port = service["metadata"]["namespace"], service["spec"]["ports"][0]["port"]
    assert f"http://detour.{ns}.svc.cluster.local:{port}" in doc


def test_the_monitoring_secret_in_the_doc_is_what_the_monitors_read(tmp_path: Path) -> None:
    """docs/deploy.md's "Monitoring" block, run as written but with `kubectl create` as a
    client-side dry run (no cluster here) and `kubectl apply` left out: the token is made,
    and the Secret holds the token under the key Prometheus reads and its entry, which
    Detour accepts as a tokens file, under the key the sidecars mount."""
    from service.auth import parse_tokens

    doc = DOC.read_text(encoding="utf-8")
    section = doc.split("\n## Monitoring", 1)[1]
    m = re.search(r"```sh\n(.*?)```", section, re.S)
    assert m, "docs/deploy.md lost its Monitoring block"
    lines = m.group(1).replace("\\\n", " ").splitlines()
    assert any("kubectl apply -k deploy/observability" in line for line in lines)
    commands = []
    for line in lines:
        command = line.split("#", 1)[0].strip()
        if command.startswith("kubectl apply"):
            continue
        if command.startswith("kubectl") and " create " in command:
            command += " --dry-run=client -o json"
        commands.append(command)
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(commands)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    secret = json.loads(out.stdout)
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    monitor = _one(_render("observability"), "ServiceMonitor", "detour")
    (endpoint,) = monitor["spec"]["endpoints"]
    ref = endpoint["authorization"]["credentials"]
    assert secret["metadata"] == {"name": ref["name"], "namespace": "detour",
                                  "creationTimestamp": None}
    token = data[ref["key"]]
    assert token.startswith("dtr_") and token == token.strip()
    sidecar_docs = _render("overlays/sidecar")
    pod = _one(sidecar_docs, "Deployment", "example-producer")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == ref["name"]]
    (item,) = volume["secret"]["items"]
    table = parse_tokens(data[item["key"]], "the Secret's entry", serves_namespaces=False)
    principal = table.lookup(token)
    assert principal is not None and principal.may("GET", "/metrics")
    assert principal.scrape_namespaces() is None  # every namespace's series


def test_the_external_redis_overlay_in_the_doc_renders(tmp_path: Path) -> None:
    """docs/deploy.md's overlay for a managed Redis, placed beside the others as it says."""
    doc = DOC.read_text(encoding="utf-8")
    m = re.search(r"```yaml\n# kustomization.yaml\n(.*?)```", doc, re.S)
    assert m, "docs/deploy.md lost its external Redis overlay"
    overlay = tmp_path / "prod"
    overlay.mkdir()
    # kustomize resolves `../shared` from the overlay: make it the real one from here.
    shared = os.path.relpath(DEPLOY / "overlays" / "shared", overlay)
    (overlay / "kustomization.yaml").write_text(m.group(1).replace("../shared", shared))
    url = "rediss://:pw@my-redis.example:6380/0"
    (overlay / "redis.env").write_text(f"url={url}\n")
    docs = _kustomize(overlay)
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "Service"} == {"detour"}
    # Nothing of the bundled Redis is left behind (its budget, its NetworkPolicy).
    assert not [d for d in docs if d["metadata"]["name"] == "detour-redis"], \
        [d["kind"] for d in docs if d["metadata"]["name"] == "detour-redis"]
    deploy = _one(docs, "Deployment", "detour")
    ref = _env(deploy["spec"]["template"]["spec"]["containers"][0])["DETOUR_REDIS_URL"]
    secret = _one(docs, "Secret", ref["valueFrom"]["secretKeyRef"]["name"])
    assert base64.b64decode(secret["data"]["url"]).decode() == url


def _args(container: dict[str, Any], password: str) -> list[str]:
    """A container's args as redis-server takes them, the password expanded."""
    return [a.replace("$(REDIS_PASSWORD)", password) for a in container["args"]]


def test_fanout_overlay_replicates_with_its_acl_and_lists_every_replica() -> None:
    """deploy/overlays/fanout: the sidecar lists one address per replica of the StatefulSet,
    and its Redis args work on real servers: the replica authenticates as `replicator`
    (PSYNC, REPLCONF, PING only), replicates, and serves `detour` read-only."""
    from tests.procs import RedisServer, wait_until

    docs = _render("overlays/fanout")
    replicas = _one(docs, "StatefulSet", "detour-redis-replica")
    sidecar = _one(docs, "Deployment", "example-producer")["spec"]["template"]["spec"][
        "initContainers"][0]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    listed = env["DETOUR_REDIS_REPLICAS"]
    # the flush interval the sizing assumes for such a fleet, and one the service takes
    assert env["DETOUR_REPORT_FLUSH_MS"] == "10000"
    assert Settings(report_flush_ms=int(env["DETOUR_REPORT_FLUSH_MS"])).report_flush_ms == 10_000
    assert listed == ",".join(f"detour-redis-replica-{i}.detour-redis-replica:6379"
                              for i in range(replicas["spec"]["replicas"]))
    primary_c = _one(docs, "StatefulSet", "detour-redis")["spec"]["template"]["spec"][
        "containers"][0]
    replica_c = replicas["spec"]["template"]["spec"]["containers"][0]
    keep = {"--user", "--replica-read-only", "--masteruser", "--masterauth"}

    def server_args(args: list[str]) -> list[str]:
        """The ACL and replication options (the rest is paths and sizes for a pod)."""
        out, i = [], 0
        while i < len(args):
            if args[i] == "--user":
                j = i + 1
                while j < len(args) and not args[j].startswith("--"):
                    j += 1
                out += args[i:j]
                i = j
            elif args[i] in keep:
                out += args[i:i + 2]
                i += 2
            else:
                i += 2 if i + 1 < len(args) and not args[i + 1].startswith("--") else 1
        return out

    password = "pw-fanout"
    # (not the manifest's: a test's full sync need not wait 5 s for more replicas)
    primary = RedisServer(extra=[*server_args(_args(primary_c, password)),
                                 "--repl-diskless-sync-delay", "0"])
    replica = RedisServer(extra=[*server_args(_args(replica_c, password)),
                                 "--replicaof", "127.0.0.1", str(primary.port)])
    try:
        import redis as redis_py

        def link(port: int, user: str) -> redis_py.Redis:
            return redis_py.Redis(host="127.0.0.1", port=port, username=user, password=password,
                                  decode_responses=True, socket_timeout=2)

        with link(primary.port, "detour") as p, link(replica.port, "detour") as r:
            p.set("detour:x", "1")
            wait_until(lambda: r.get("detour:x") == "1", 20, "replicated as replicator")
            with pytest.raises(redis_py.ReadOnlyError):
                r.set("detour:y", "1")
        refused = redis_py.exceptions.NoPermissionError
        with link(primary.port, "replicator") as rep, pytest.raises(refused):
            rep.get("detour:x")  # the replication user reads nothing itself
    finally:
        replica.stop()
        primary.stop()
