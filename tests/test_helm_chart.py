"""The Helm chart, checked without Helm: Chart.yaml, values.yaml against values.schema.json,
every value documented, every `.Values` reference in a template defined and every value
used, the templates' block structure and named templates, and the monitoring files being
the repository's own. `helm lint` and `helm template` must run where Helm is installed."""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.procs import ROOT

pytestmark = pytest.mark.integration

CHART = ROOT / "helm" / "detour"
TEMPLATES = CHART / "templates"
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"
#: `.Values.a.b` anywhere in a template (`$.Values` included).
VALUES_REF = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
ACTION = re.compile(r"\{\{-?(.*?)-?\}\}", re.S)
BLOCK_OPEN = re.compile(r"^\s*(if|with|range|define|block)\b")
BLOCK_END = re.compile(r"^\s*end\s*$")
#: The Kubernetes kinds of the kustomize base and shared overlay the chart mirrors.
MIRRORED_KINDS = {
    "Deployment",
    "Service",
    "PodDisruptionBudget",
    "ConfigMap",
    "Secret",
    "StatefulSet",
    "HorizontalPodAutoscaler",
    "ServiceMonitor",
    "PrometheusRule",
    "NetworkPolicy",
}


def _values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _schema() -> dict[str, Any]:
    return json.loads(SCHEMA.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _templates() -> dict[str, str]:
    return {
        p.name: p.read_text(encoding="utf-8") for p in sorted(TEMPLATES.iterdir()) if p.is_file()
    }


def _flatten(tree: Any, prefix: str = "") -> set[str]:
    """Every key path of a mapping, inner ones included: {"a": {"b": 1}} -> {"a", "a.b"}."""
    out: set[str] = set()
    if isinstance(tree, dict):
        for key, value in tree.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out.add(path)
            out |= _flatten(value, path)
    return out


def _leaves(tree: Any, prefix: str = "") -> set[str]:
    """Key paths of the values themselves: scalars, lists and empty maps."""
    if not isinstance(tree, dict) or (not tree and prefix):
        return {prefix} if prefix else set()
    out: set[str] = set()
    for key, value in tree.items():
        out |= _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    return out


def _references() -> dict[str, set[str]]:
    """Each `.Values` path a template uses -> the templates using it."""
    refs: dict[str, set[str]] = {}
    for name, text in _templates().items():
        for m in VALUES_REF.finditer(text):
            refs.setdefault(m.group(1).lstrip("."), set()).add(name)
    return refs


def _validator() -> jsonschema.Draft7Validator:
    schema = _schema()
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


# ----------------------------------------------------------------------------- Chart.yaml
def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == CHART.name == "detour"
    assert chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+(-[\w.]+)?", chart["version"]), chart["version"]
    assert chart["appVersion"] == project["version"], "the chart deploys this Detour"
    assert isinstance(chart["appVersion"], str), "quote appVersion: 0.10 is not 0.1"
    assert re.fullmatch(r">=1\.\d+\.\d+-0", chart["kubeVersion"])
    assert chart["description"].strip()
    for required in ("_helpers.tpl", "NOTES.txt"):
        assert (TEMPLATES / required).is_file(), required


def test_the_chart_carries_the_projects_licence() -> None:
    """One licence everywhere: pyproject.toml, the image label, the chart's annotation and
    the LICENSE text (Apache-2.0, Debian's copy of it where the machine has one)."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    (label,) = re.findall(r'org\.opencontainers\.image\.licenses="([^"]+)"', dockerfile)
    assert project["license"] == label == chart["annotations"]["artifacthub.io/license"] \
        == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    debian = Path("/usr/share/common-licenses/Apache-2.0")
    if debian.is_file():
        assert text == debian.read_text(encoding="utf-8")
    # `helm package` stores the licence with the chart (a link, so it cannot drift).
    shipped = CHART / "LICENSE"
    assert shipped.is_symlink() and shipped.resolve() == (ROOT / "LICENSE").resolve()


# --------------------------------------------------------------------------------- values
def test_values_are_valid_against_the_schema() -> None:
    validator = _validator()
    errors = sorted(validator.iter_errors(_values()), key=str)
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ("replicaCount", 0),
        ("image.pullPolicy", "Sometimes"),
        ("config.logLevel", "loud"),
        ("config.workers", 0),
        ("config.extraEnv", {"SOMETHING_ELSE": "1"}),
        ("externalRedis.url", "http://redis:6379"),
        ("service.port", 70000),
        ("serviceMonitor.interval", "often"),
        ("redis.persistence.size", "1 GB"),
        ("unknownTopLevel", True),
        ("autoscaling.typo", True),
        ("probes.startup.periodSeconds", 0),
        ("probes.liveness.httpGet", {"path": "healthz", "port": "http"}),
        ("securityContext.readOnlyRootFilesytem", True),
        ("podSecurityContext.runAsUser", -1),
        ("networkPolicy.ingressFrom", []),
        ("redisAuth.username", "has space"),
        ("redis.podDisruptionBudget.maxUnavailable", 2),
    ],
)
def test_the_schema_rejects_bad_values(path: str, bad: Any) -> None:
    values = copy.deepcopy(_values())
    *parents, leaf = path.split(".")
    node = values
    for key in parents:
        node = node[key]
    node[leaf] = bad
    assert list(_validator().iter_errors(values)), f"{path}={bad!r} passed the schema"


def test_the_schema_describes_exactly_the_values() -> None:
    """Both directions: no value the schema forgets, no schema entry left from a removed value
    (free-form maps such as resources or podLabels end the walk)."""

    def walk(schema: dict[str, Any], values: Any, where: str) -> None:
        props = schema.get("properties")
        if props is None or not isinstance(values, dict):
            return
        assert set(props) == set(values), (
            f"{where or 'top level'}: schema only {sorted(set(props) - set(values))}, "
            f"values only {sorted(set(values) - set(props))}"
        )
        assert schema.get("additionalProperties") is False, f"{where}: typos would pass"
        for key, sub in props.items():
            walk(sub, values[key], f"{where}.{key}" if where else key)

    walk(_schema(), _values(), "")


def test_every_value_is_commented() -> None:
    """Each key has a comment line directly above it. A `# --` comment documents a value as a
    whole (resources, labels): the keys inside it are its example and need none of their own."""
    lines = VALUES.read_text(encoding="utf-8").splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, documented as a whole) of the open keys
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z_][\w-]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        j = i
        while j and lines[j - 1].strip().startswith("#"):
            j -= 1  # to the first line of the comment block above
        commented = j < i
        if not commented and not any(whole for _, whole in stack):
            undocumented.append(f"values.yaml:{i + 1}: {line.strip()}")
        stack.append((indent, commented and lines[j].strip().startswith("# --")))
    assert not undocumented, undocumented


# ------------------------------------------------------------------------------ templates
def test_every_template_reference_exists_in_values_and_every_value_is_used() -> None:
    keys = _flatten(_values())
    refs = _references()
    missing = {ref: sorted(where) for ref, where in refs.items() if ref not in keys}
    assert not missing, f"templates use values that values.yaml lacks: {missing}"
    # A value is used when a template names it or one of its parents (toYaml .Values.resources).
    unused = sorted(
        k for k in _leaves(_values()) if not any(k == r or k.startswith(r + ".") for r in refs)
    )
    assert not unused, f"values.yaml entries no template uses: {unused}"


def test_templates_are_well_formed() -> None:
    templates = _templates()
    defined: dict[str, str] = {}
    used: set[str] = set()
    for name, text in templates.items():
        assert text.count("{{") == text.count("}}"), f"{name}: unbalanced delimiters"
        depth = 0
        for m in ACTION.finditer(text):
            action = m.group(1).strip()
            if action.startswith("/*"):
                assert action.endswith("*/"), f"{name}: unclosed comment {action[:40]}"
                continue
            if BLOCK_OPEN.match(action):
                depth += 1
            elif BLOCK_END.match(action):
                depth -= 1
                assert depth >= 0, f"{name}: `end` without a block"
            d = re.match(r'define\s+"([^"]+)"', action)
            if d:
                assert d.group(1) not in defined, f"{d.group(1)} defined twice"
                assert d.group(1).startswith("detour."), "namespace named templates"
                defined[d.group(1)] = name
            used.update(re.findall(r'(?:include|template)\s+"([^"]+)"', action))
        assert depth == 0, f"{name}: {depth} block(s) never closed"
    assert set(defined.values()) == {"_helpers.tpl"}, "named templates live in _helpers.tpl"
    assert used <= set(defined), f"undefined named templates: {sorted(used - set(defined))}"
    assert set(defined) <= used, f"named templates nobody uses: {sorted(set(defined) - used)}"
    # Selectors never carry the chart version (they are immutable once applied).
    selector = re.search(r'define "detour.selectorLabels".*?end', templates["_helpers.tpl"], re.S)
    assert selector and "Chart.Version" not in selector.group(0)
    assert "detour.chart" not in selector.group(0)


def test_templates_mirror_the_kustomize_objects_with_standard_labels() -> None:
    kinds: set[str] = set()
    for name, text in _templates().items():
        if not name.endswith(".yaml"):
            continue
        found = re.findall(r"^kind:\s*(\w+)\s*$", text, flags=re.M)
        assert found, f"{name} declares no object"
        kinds.update(found)
        # Every object carries the common labels.
        assert text.count('include "detour.labels"') >= len(found), name
        assert text.count("namespace: {{ .Release.Namespace }}") == len(found), name
    assert kinds >= MIRRORED_KINDS, f"missing kinds: {sorted(MIRRORED_KINDS - kinds)}"


def test_monitoring_files_are_the_repository_files() -> None:
    """files/ links to deploy/: the chart ships the dashboard and rules the tests check."""
    for name, original in (
        ("detour.json", ROOT / "deploy/grafana/detour.json"),
        ("rules.yaml", ROOT / "deploy/prometheus/rules.yaml"),
    ):
        shipped = CHART / "files" / name
        assert shipped.is_symlink(), f"{shipped} should link to {original}, not copy it"
        assert shipped.resolve() == original.resolve()
        assert shipped.read_bytes() == original.read_bytes()
    gets = set()
    for text in _templates().values():
        gets.update(re.findall(r'\.Files\.Get\s+"([^"]+)"', text))
    assert gets == {"files/detour.json", "files/rules.yaml"}
    for path in gets:
        assert (CHART / path).is_file(), path
    # The rule file is read as YAML and its groups rendered: it must have them.
    assert yaml.safe_load((CHART / "files/rules.yaml").read_text(encoding="utf-8"))["groups"]


def test_defaults_match_the_kustomize_base() -> None:
    """The chart's defaults are the base's: the same resources, port and Redis settings."""
    values = _values()
    base = ROOT / "deploy" / "base"
    deployment = yaml.safe_load((base / "deployment.yaml").read_text(encoding="utf-8"))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert values["resources"] == container["resources"]
    assert values["replicaCount"] == deployment["spec"]["replicas"]
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert values["terminationGracePeriodSeconds"] == grace
    redis = next(
        d
        for d in yaml.safe_load_all((base / "redis.yaml").read_text(encoding="utf-8"))
        if d["kind"] == "StatefulSet"
    )
    (rc,) = redis["spec"]["template"]["spec"]["containers"]
    assert values["redis"]["resources"] == rc["resources"]
    image, tag = rc["image"].split(":")
    assert (values["redis"]["image"]["repository"], values["redis"]["image"]["tag"]) == (image, tag)
    args = rc["args"]
    assert values["redis"]["maxmemory"] == args[args.index("--maxmemory") + 1]
    # Probes and security contexts are values now, with the base's as their defaults.
    pod = deployment["spec"]["template"]["spec"]
    assert values["probes"] == {"startup": container["startupProbe"],
                                "readiness": container["readinessProbe"],
                                "liveness": container["livenessProbe"]}
    assert values["securityContext"] == container["securityContext"]
    assert values["podSecurityContext"] == pod["securityContext"]
    assert values["redis"]["securityContext"] == rc["securityContext"]
    assert values["redis"]["podSecurityContext"] == redis["spec"]["template"]["spec"][
        "securityContext"]
    # Redis auth: the same Secret and key, the same ACL users and rules.
    ref = next(e for e in rc["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
    assert (values["redisAuth"]["existingSecret"], values["redisAuth"]["secretKey"]) == (
        ref["name"], ref["key"])
    template = (TEMPLATES / "redis.yaml").read_text(encoding="utf-8")
    users = args[:args.index("--appendonly")]
    assert users.count("--user") == 2 and values["redisAuth"]["username"] == users[7]
    for arg in users:
        shown = "{{ .Values.redisAuth.username }}" if arg == users[7] else arg
        assert re.search(r'^\s+- "?' + re.escape(shown) + r'"?$', template, re.M), arg
    pdb = next(d for d in yaml.safe_load_all((base / "redis.yaml").read_text(encoding="utf-8"))
               if d["kind"] == "PodDisruptionBudget")
    assert values["redis"]["podDisruptionBudget"]["maxUnavailable"] == \
        pdb["spec"]["maxUnavailable"]
    policies = list(yaml.safe_load_all((base / "networkpolicy.yaml").read_text(encoding="utf-8")))
    detour_policy = next(d for d in policies if d["metadata"]["name"] == "detour")
    assert values["networkPolicy"]["ingressFrom"] == detour_policy["spec"]["ingress"][0]["from"]
    env = dict(
        line.split("=", 1)
        for line in (base / "config.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert str(values["config"]["workers"]) == env["DETOUR_WORKERS"]
    assert values["config"]["logLevel"] == env["DETOUR_LOG_LEVEL"]
    assert values["config"]["namespace"] == env["DETOUR_NAMESPACE"]
    assert str(values["config"]["shutdownGraceSeconds"]) == env["DETOUR_SHUTDOWN_GRACE_S"]
    assert Path(env["DETOUR_TOKENS_FILE"]).name == values["auth"]["secretKey"]
