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
``python -m pipeline.X`` and ``spark-submit pipeline/X.py`` behave alike, and how
the pipeline's own code reaches executors that do not have the repository.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: The repository root: ``pipeline`` and ``service`` live under it.
ROOT = Path(__file__).resolve().parents[1]

#: Packages the executors import (the producer SDK lives in ``service.client``).
SHIPPED_PACKAGES = ("pipeline", "service")


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

    if master is None and not under_spark_submit():
        master = "local[*]"
    if (master or "").startswith("local") and "PYSPARK_PYTHON" not in os.environ:
        os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = SparkSession.builder.appName(app)
    if master is not None:
        builder = builder.master(master)
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(os.environ.get("DETOUR_SPARK_LOG_LEVEL", "WARN"))
    return session


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
