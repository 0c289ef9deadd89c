"""Build the detour-client wheel: the producer SDK without the service's web stack.

    .venv/bin/python -m sdk.build --out dist    # dist/detour_client-<version>-py3-none-any.whl
    .venv/bin/python -m sdk.build --fetch-dependencies DIR    # its dependencies (make setup)

The sources are this repository's own: ``service/__init__.py``, the ``service/client``
package and the pure modules ``sdk/pyproject.toml`` lists under ``py-modules``. A
pyproject.toml cannot reach files outside its directory, so they are staged into a
temporary directory with ``sdk/pyproject.toml`` and built there by ``pip wheel
--no-build-isolation --no-deps --no-index``: the setuptools already installed builds
it, nothing is fetched, nothing is written into the repository.

``--fetch-dependencies`` downloads wheels of the distribution's dependencies at the
versions ``requirements.lock`` pins; ``make setup`` keeps them in the virtualenv so the
test that installs the SDK into a fresh virtualenv runs offline.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SDK = ROOT / "sdk"


def project() -> dict[str, Any]:
    """``sdk/pyproject.toml``, parsed."""
    return tomllib.loads((SDK / "pyproject.toml").read_text(encoding="utf-8"))


def shipped_files() -> list[Path]:
    """Every source file the wheel holds, relative to the repository root."""
    config = project()["tool"]["setuptools"]
    files = {Path("service/__init__.py")}
    for package in config["packages"]:
        folder = Path(*package.split("."))
        files |= {p.relative_to(ROOT) for p in (ROOT / folder).glob("*.py")}
    for module in config["py-modules"]:
        files.add(Path(*module.split(".")).with_suffix(".py"))
    return sorted(files)


def stage(dest: Path) -> None:
    """Lay the distribution's sources out under ``dest`` as a project of its own."""
    shutil.copy2(SDK / "pyproject.toml", dest / "pyproject.toml")
    shutil.copy2(SDK / "README.md", dest / "README.md")
    for rel in shipped_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)


def build(out: Path) -> Path:
    """Build the wheel into ``out``; returns its path. Raises CalledProcessError."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="detour-client-") as tmp:
        stage(Path(tmp))
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
             "--no-index", "--quiet", "--wheel-dir", str(out), tmp],
            check=True,
        )
    version = project()["project"]["version"]
    return out / f"detour_client-{version}-py3-none-any.whl"


def fetch_dependencies(dest: Path) -> None:
    """Wheels of the distribution's dependencies, pinned by requirements.lock, into ``dest``."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
         "--dest", str(dest), "--constraint", str(ROOT / "requirements.lock"),
         *project()["project"]["dependencies"]],
        check=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="where the wheel goes")
    parser.add_argument("--fetch-dependencies", type=Path, metavar="DIR",
                        help="download the dependencies' wheels into DIR instead of building")
    args = parser.parse_args(argv)
    if args.fetch_dependencies:
        fetch_dependencies(args.fetch_dependencies)
    else:
        print(build(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
