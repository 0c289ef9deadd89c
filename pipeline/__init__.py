"""Detour's Spark data pipeline: produce a dataset through Detour to brokers that fail for real.

Why a pipeline at all: Detour's claim is that one producer's failure protects
every producer. A Spark job is the natural many-producer client (one Detour
client per partition, on every executor), so this package is both a usable
batch producer and the end-to-end proof, against real broker processes that are
stopped, killed and slowed mid-run:

    generate    a sample dataset of any size with a unique ``id`` per record
    brokers     stand-in brokers (redis-server processes) and the fault injector
    produce     the Spark job: send every record with the SDK's send loop
    verify      every record id is on some broker (duplicates reported apart)
    export_log  Detour's latency log to Parquet
    analyze     per-broker latency, isolations, avoided time; recommended tiers

This module holds the little the jobs share: how a SparkSession is built so that
``python -m pipeline.X`` and ``spark-submit pipeline/X.py`` behave alike, how
the pipeline's own code reaches executors that do not have the repository, and
where a program finds its Detour token (``--token``, else ``DETOUR_TOKEN``).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: The repository root: ``pipeline`` and ``service`` live under it.
ROOT = Path(__file__).resolve().parents[1]

#: Packages the executors import (the producer SDK lives in ``detour.client``).
SHIPPED_PACKAGES = ("pipeline", "service")

#: Spark's log configuration for the jobs (the level is ``DETOUR_SPARK_LOG_LEVEL``).
LOG4J_CONFIG = Path(__file__).resolve().parent / "log4j2.properties"
JAVA_OPTIONS = "spark.driver.extraJavaOptions"

#: Where every pipeline program looks for its Detour token when ``--token`` is not given.
TOKEN_ENV = "DETOUR_TOKEN"


def add_token_argument(parser: argparse.ArgumentParser, role: str) -> None:
    """``--token``: the Detour token the program sends (needs role ``role``)."""
    parser.add_argument(
        "--token", default=None,
        help=f"Detour {role} token, sent as 'Authorization: Bearer' (default: ${TOKEN_ENV}; "
             "prefer the variable, a flag shows in the process list; '' sends none)",
    )


def detour_token(flag: str | None = None) -> str | None:
    """The token to send: ``flag`` (``--token``) when given, else ``$DETOUR_TOKEN``.

    None means no ``Authorization`` header (a Detour without tokens, on loopback);
    an empty string counts as not set.
    """
    token = flag if flag is not None else os.environ.get(TOKEN_ENV)
    return token or None


def auth_headers(token: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}``, or nothing when there is no token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def under_spark_submit() -> bool:
    """True when ``spark-submit`` launched this driver (it hands the gateway over by env)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def spark_session(
    app: str,
    master: str | None = None,
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A SparkSession for one job, the same whether run by ``python -m`` or ``spark-submit``.

    ``master``: None keeps what spark-submit chose, or ``local[*]`` for a plain
    ``python`` run. A local run's Python workers use this interpreter unless
    PYSPARK_PYTHON says otherwise (Spark's default, ``python3`` from PATH, is
    usually not the virtualenv that has redis-py and httpx).
    """
    from pyspark.sql import SparkSession

    launching = not under_spark_submit()  # else the driver JVM is already running
    if master is None and launching:
        master = "local[*]"
    local = (master or "").startswith("local")
    if local and "PYSPARK_PYTHON" not in os.environ:
        os.environ["PYSPARK_PYTHON"] = sys.executable
    if local and launching:
        # Every socket of a local run on loopback: the driver, the block manager and the
        # UI, which otherwise binds 0.0.0.0:4040.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings = dict(conf or {})
    if launching:
        settings[JAVA_OPTIONS] = quiet_java_options(settings.get(JAVA_OPTIONS))
    builder = SparkSession.builder.appName(app)
    if master is not None:
        builder = builder.master(master)
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(os.environ.get("DETOUR_SPARK_LOG_LEVEL", "WARN"))
    return session


def announce(spark: SparkSession, job: str, out: TextIO | None = None) -> None:
    """One line on stderr once Spark is up: the start (several seconds) is over, and where
    its UI is (on loopback for a local run)."""
    sc = spark.sparkContext
    print(f"{job}: Spark {spark.version} up, master {sc.master}, UI {sc.uiWebUrl or 'off'}",
          file=out or sys.stderr, flush=True)


def quiet_java_options(options: str | None) -> str:
    """The driver's JVM options with ``LOG4J_CONFIG`` as its log configuration.

    Why at launch: ``setLogLevel`` acts once Spark is up, after the INFO lines of its
    start; the file applies ``DETOUR_SPARK_LOG_LEVEL`` from the JVM's first line. A
    configuration the caller already names is kept.
    """
    options = (options or "").strip()
    if "log4j2.configurationFile" in options:
        return options
    return f"{options} -Dlog4j2.configurationFile={LOG4J_CONFIG.as_uri()}".strip()


def ship_code(spark: SparkSession) -> Path | None:
    """Zip ``pipeline`` and ``service`` and add them to every executor's ``sys.path``.

    Why: ``spark-submit pipeline/produce.py`` ships only that file; the executors
    also need the SDK and the shared strategy code. An image that already has the
    packages installed loses nothing (the zip holds the same code). Returns the
    zip, or None when it was already shipped to this SparkContext.
    """
    sc = spark.sparkContext
    if getattr(sc, "_detour_shipped", False):
        return None
    tmp = tempfile.mkdtemp(prefix="detour-pipeline-")
    atexit.register(shutil.rmtree, tmp, True)  # Spark has its own copy once added
    out = Path(tmp) / "detour_pipeline.zip"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for package in SHIPPED_PACKAGES:
            for path in sorted((ROOT / package).rglob("*")):
                if "__pycache__" in path.parts or not path.is_file():
                    continue
                if path.suffix not in (".py", ".lua", ".html"):
                    continue
                zf.write(path, path.relative_to(ROOT).as_posix())
    sc.addPyFile(str(out))
    sc._detour_shipped = True  # type: ignore[attr-defined]
    return out
