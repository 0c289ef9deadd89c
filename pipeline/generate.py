"""Make a sample input for the producing job: N records, each with a unique ``id``.

Why generated and not shipped: the end-to-end test and the benchmark need
datasets of a chosen size and format, and ``verify`` needs to know every id that
should arrive. Ids are ``rec-`` plus the zero-padded row number, so they are
unique, sortable and readable in a broker's stream; the payload is a
deterministic hex string of ``--payload-bytes`` derived from the id, so two runs
with the same arguments produce the same data.

    python -m pipeline.generate --records 20000 --out /tmp/in --format parquet
    spark-submit pipeline/generate.py --records 1000000 --out s3a://bucket/in --partitions 64
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pipeline import spark_session

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

Format = Literal["parquet", "json", "csv"]
FORMATS: tuple[str, ...] = ("parquet", "json", "csv")

#: Digits in an id's number: 12 covers any dataset this job will see.
ID_DIGITS = 12


def record_id(n: int) -> str:
    """The id of row ``n`` (what ``generate`` writes), e.g. ``rec-000000000042``."""
    return f"rec-{n:0{ID_DIGITS}d}"


def sample(spark: SparkSession, records: int, partitions: int, payload_bytes: int) -> DataFrame:
    """The records as a DataFrame ``(id string, payload string, n long)``."""
    from pyspark.sql import functions as F

    if records < 0 or partitions < 1 or payload_bytes < 1:
        raise ValueError("records >= 0, partitions >= 1 and payload_bytes >= 1")
    ids = F.concat(F.lit("rec-"), F.lpad(F.col("id").cast("string"), ID_DIGITS, "0"))
    digest = F.sha2(ids, 256)  # 64 hex chars; repeated to the wanted size
    repeats = payload_bytes // 64 + 1
    payload = F.substring(F.repeat(digest, repeats), 1, payload_bytes)
    return (
        spark.range(0, records, numPartitions=partitions)
        .select(ids.alias("id"), payload.alias("payload"), F.col("id").alias("n"))
    )


def write(df: DataFrame, out: str, fmt: Format) -> None:
    writer = df.write.mode("overwrite")
    if fmt == "parquet":
        writer.parquet(out)
    elif fmt == "json":
        writer.json(out)
    elif fmt == "csv":
        writer.option("header", True).csv(out)
    else:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def generate(
    spark: SparkSession,
    records: int,
    out: str,
    fmt: Format = "parquet",
    partitions: int = 4,
    payload_bytes: int = 64,
) -> int:
    """Write ``records`` records to ``out`` in ``fmt``; returns how many were written."""
    write(sample(spark, records, partitions, payload_bytes), out, fmt)
    return records


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, required=True)
    p.add_argument("--out", required=True, help="output path (a directory, Spark-style)")
    p.add_argument("--format", choices=FORMATS, default="parquet")
    p.add_argument("--partitions", type=int, default=4, help="output files (default 4)")
    p.add_argument("--payload-bytes", type=int, default=64)
    p.add_argument("--master", default=None, help="default: spark-submit's, else local[*]")
    args = p.parse_args(argv)
    spark = spark_session("detour-generate", args.master, {"spark.ui.showConsoleProgress": "false"})
    try:
        n = generate(spark, args.records, args.out, args.format, args.partitions,
                     args.payload_bytes)
        print(f"wrote {n} records to {args.out} ({args.format})")
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
