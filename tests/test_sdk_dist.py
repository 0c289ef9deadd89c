"""The detour-client distribution: the producer SDK installed alone, offline, and producing.

``sdk/pyproject.toml`` lists what the wheel holds besides ``service.client``; an import
trace of every module of ``service.client`` in a fresh interpreter must load exactly
those ``service`` modules, so a pure module the SDK starts to import cannot be left out
(nor a dropped one kept). The wheel is built offline (``python -m sdk.build``), installed
into a fresh virtualenv from the dependency wheels ``make setup`` keeps in ``.venv``
(``--no-index``: nothing is downloaded), and the test checks what came in, then
produces through a live Detour process with the SDK of that virtualenv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import httpx
import pytest
from packaging.utils import canonicalize_name

from sdk.build import build, project, shipped_files
from tests.procs import ROOT, ServiceProcess
from tests.test_client_import import SCRIPT

#: Where `make setup` puts the wheels of the SDK's dependencies (sdk.build --fetch-dependencies).
WHEELS = ROOT / ".venv" / "wheels" / "detour-client"
#: The service's stack: none of it may reach a producer that installs the SDK.
WEB_STACK = {"fastapi", "starlette", "uvicorn", "redis", "hiredis", "prometheus-client",
             "pydantic", "pydantic-core", "pydantic-settings"}

TRACE = """
import importlib, json, pkgutil, sys
import service.client
for m in pkgutil.iter_modules(service.client.__path__):
    importlib.import_module("service.client." + m.name)
print(json.dumps(sorted(sys.modules)))
"""


def _python_env() -> dict[str, str]:
    """The environment for the fresh virtualenv's pip and Python: no pip configuration
    (no index, no find-links from this machine), nothing of this repository on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INPUT": "1"}


@pytest.mark.unit
def test_the_distribution_ships_exactly_what_the_sdk_imports() -> None:
    out = subprocess.run([sys.executable, "-c", TRACE], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    loaded = set(json.loads(out.stdout))
    imported = {m for m in loaded if m == "service" or m.startswith("service.")}
    shipped = {".".join(p.with_suffix("").parts).removesuffix(".__init__") for p in shipped_files()}
    assert imported == shipped, (
        f"imported, not shipped: {sorted(imported - shipped)}; "
        f"shipped, not imported: {sorted(shipped - imported)} (sdk/pyproject.toml py-modules)"
    )
    assert not {m.partition(".")[0] for m in loaded} & {n.replace("-", "_") for n in WEB_STACK}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("dist"))


@pytest.mark.integration
def test_the_wheel_holds_the_sdk_and_depends_on_httpx_only(wheel: Path) -> None:
    main = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = Parser().parsestr(zf.read("detour_client-0.1.0.dist-info/METADATA").decode())
    assert {n for n in names if ".dist-info/" not in n} == {p.as_posix() for p in shipped_files()}
    assert not any(n.startswith(("service/store/", "service/api/", "service/app")) for n in names)
    assert (meta["Name"], meta["Version"]) == ("detour-client", main["version"])
    httpx_pin = next(d for d in main["dependencies"] if d.startswith("httpx"))
    assert meta.get_all("Requires-Dist") == [httpx_pin] == project()["project"]["dependencies"]


@pytest.mark.e2e
@pytest.mark.slow
def test_the_sdk_installs_alone_offline_and_produces(
    wheel: Path, service: ServiceProcess, tmp_path: Path
) -> None:
    if not any(WHEELS.glob("httpx-*.whl")):
        pytest.fail(f"no dependency wheels in {WHEELS}: run `make setup`")
    venv = tmp_path / "producer-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = _python_env()
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(WHEELS),
         "--find-links", str(wheel.parent), "detour-client"],
        check=True, timeout=300, env=env, cwd=tmp_path,
    )

    listed = subprocess.run(
        [python, "-c", "import importlib.metadata as m, json; "
                       "print(json.dumps([d.metadata['Name'] for d in m.distributions()]))"],
        check=True, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )
    installed = {canonicalize_name(n) for n in json.loads(listed.stdout)} - {"pip", "setuptools"}
    fetched = {canonicalize_name(w.name.split("-")[0]) for w in WHEELS.glob("*.whl")}
    assert not installed & WEB_STACK
    assert installed == {"detour-client"} | fetched  # httpx and its own dependencies, no more
    assert "httpx" in fetched

    httpx.put(f"{service.url}/routes/imp", json={"brokers": [
        {"brokerName": "imp-a", "writeQueueNums": 1}]}, timeout=5).raise_for_status()
    where = "import service, service.client; print(service.__file__)"
    script = SCRIPT.replace('print("ok")', 'print("ok")\n' + where)
    run = subprocess.run([python, "-c", script, service.url], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    ok, path = run.stdout.split()
    assert ok == "ok" and Path(path).is_relative_to(venv)  # the installed SDK, not this tree
    missing = subprocess.run([python, "-c", "import service.app"], capture_output=True,
                             text=True, timeout=60, env=env, cwd=tmp_path)
    assert "ModuleNotFoundError" in missing.stderr  # the service itself did not come along
