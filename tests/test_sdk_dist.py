"""The detour-client distribution: built with standard tooling, installed alone, offline.

The repository's ``pyproject.toml`` is the distribution: the ``detour`` package (the pure
core and the SDK), httpx its only dependency. The wheel is built in a fresh virtualenv by
its own pip (``pip wheel``, build isolation, the build backend from the wheels ``make
setup`` keeps: ``--no-index``, nothing is downloaded), installed into another fresh
virtualenv, and produces through a live Detour process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import httpx
import pytest
from packaging.utils import canonicalize_name

from tests.procs import ROOT, ServiceProcess
from tests.test_client_import import SCRIPT

#: Where `make setup` puts the wheels of the SDK's dependencies and of its build backend.
WHEELS = ROOT / ".venv" / "wheels" / "detour-client"
BUILD_WHEELS = ROOT / ".venv" / "wheels" / "build"
#: The service's stack: none of it may reach a producer that installs the SDK.
WEB_STACK = {"fastapi", "starlette", "uvicorn", "redis", "hiredis", "prometheus-client",
             "pydantic", "pydantic-core", "pydantic-settings"}

TRACE = """
import importlib, json, pkgutil, sys
import detour
for m in pkgutil.walk_packages(detour.__path__, "detour."):
    importlib.import_module(m.name)
print(json.dumps(sorted(sys.modules)))
"""


def _project() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _python_env() -> dict[str, str]:
    """The environment for a fresh virtualenv's pip and Python: no pip configuration (no
    index, no find-links from this machine), nothing of this repository on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INPUT": "1"}


def _fresh_venv(where: Path, *, with_pip: bool = True) -> str:
    args = [] if with_pip else ["--without-pip"]
    subprocess.run([sys.executable, "-m", "venv", *args, str(where)], check=True, timeout=120)
    return str(where / "bin" / "python")


@pytest.fixture(scope="module")
def fresh_pip(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh virtualenv's Python, with the pip and setuptools its ``venv`` brings (the
    builder's, and the installer of the producer's virtualenv: ``pip --python``, so that
    one need not unpack a pip of its own)."""
    return _fresh_venv(tmp_path_factory.mktemp("sdk-pip") / "venv")


@pytest.mark.unit
def test_every_module_of_detour_imports_without_the_server_or_its_stack() -> None:
    out = subprocess.run([sys.executable, "-c", TRACE], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    loaded = {m.partition(".")[0] for m in json.loads(out.stdout)}
    assert "service" not in loaded
    assert not loaded & {n.replace("-", "_") for n in WEB_STACK}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory, fresh_pip: str) -> Path:
    """Built as a producer's CI would: a fresh virtualenv (its own old pip and setuptools),
    ``pip wheel`` on a clean copy of the project files (so the build writes nothing into
    this tree), the build backend installed by pip's build isolation from local wheels."""
    if not any(BUILD_WHEELS.glob("setuptools-*.whl")):
        pytest.fail(f"no build backend wheel in {BUILD_WHEELS}: run `make setup`")
    tmp = tmp_path_factory.mktemp("sdk-build")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "detour", src / "detour",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run(
        [fresh_pip, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index", "--find-links",
         str(BUILD_WHEELS), "--wheel-dir", str(tmp / "dist"), str(src)],
        check=True, timeout=300, env=_python_env(), cwd=tmp,
    )
    (built,) = (tmp / "dist").glob("detour_client-*.whl")
    return built


@pytest.mark.integration
@pytest.mark.slow
def test_the_wheel_holds_detour_only_and_depends_on_httpx_only(wheel: Path) -> None:
    project = _project()
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = Parser().parsestr(zf.read("detour_client-0.1.0.dist-info/METADATA").decode())
    tops = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert tops == {"detour"}  # no top-level `service` to collide with a producer's own
    shipped = {n for n in names if n.endswith(".py")}
    in_tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "detour").rglob("*.py")}
    assert shipped == in_tree
    assert (meta["Name"], meta["Version"]) == ("detour-client", project["version"])
    assert meta.get_all("Requires-Dist") == project["dependencies"] == ["httpx>=0.27"]
    assert meta["License-Expression"] == "Apache-2.0"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


@pytest.mark.e2e
@pytest.mark.slow
def test_the_sdk_installs_alone_offline_and_produces(
    wheel: Path, fresh_pip: str, service: ServiceProcess, tmp_path: Path
) -> None:
    if not any(WHEELS.glob("httpx-*.whl")):
        pytest.fail(f"no dependency wheels in {WHEELS}: run `make setup`")
    python = _fresh_venv(tmp_path / "producer-venv", with_pip=False)
    env = _python_env()
    # A producer application with a `service` package of its own: the SDK must not shadow
    # it, nor be shadowed by it.
    app = tmp_path / "app"
    (app / "service").mkdir(parents=True)
    (app / "service" / "__init__.py").write_text("MINE = True\n")
    subprocess.run(
        [fresh_pip, "-m", "pip", "--python", python, "install", "--quiet", "--no-index",
         "--find-links", str(WHEELS),
         "--find-links", str(wheel.parent), "detour-client"],
        check=True, timeout=300, env=env, cwd=app,
    )
    listed = subprocess.run(
        [python, "-c", "import importlib.metadata as m, json; "
                       "print(json.dumps([d.metadata['Name'] for d in m.distributions()]))"],
        check=True, capture_output=True, text=True, timeout=60, env=env, cwd=app,
    )
    installed = {canonicalize_name(n) for n in json.loads(listed.stdout)} - {"pip", "setuptools"}
    fetched = {canonicalize_name(w.name.split("-")[0]) for w in WHEELS.glob("*.whl")}
    assert not installed & WEB_STACK
    assert installed == {"detour-client"} | fetched  # httpx and its own dependencies, no more
    assert "httpx" in fetched

    httpx.put(f"{service.url}/routes/imp", json={"brokers": [
        {"brokerName": "imp-a", "writeQueueNums": 1}]}, timeout=5).raise_for_status()
    where = "import service, detour.client; print(detour.client.__file__, service.MINE)"
    script = SCRIPT.replace('print("ok")', 'print("ok")\n' + where)
    run = subprocess.run([python, "-c", script, service.url], capture_output=True, text=True,
                         timeout=120, env=env, cwd=app)
    assert run.returncode == 0, run.stderr
    ok, path, mine = run.stdout.split()
    assert ok == "ok" and mine == "True"
    assert Path(path).is_relative_to(tmp_path / "producer-venv")  # the installed SDK
    missing = subprocess.run([python, "-c", "import service.app"], capture_output=True,
                             text=True, timeout=60, env=env, cwd=tmp_path)
    assert "ModuleNotFoundError" in missing.stderr  # the server did not come along
