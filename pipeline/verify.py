"""Check that every record reached a broker: read every stream of every broker, join on ``id``.

Why read the brokers and not the producing job's results: the results say what
the producer *believed* (an acknowledged XADD); the brokers say what is there,
after SIGKILLs, restarts and a hung broker that woke up. A record is lost when
its id is on no stream of any broker. Delivery is at-least-once, so an id found
more than once is not an error, it is counted apart: a send that timed out on a
SIGSTOPped broker is retried elsewhere and also lands on the stopped one when it
gets SIGCONT.

The brokers come from the topic's route in Detour (``GET /routes/{topic}``,
which carries addresses) or from ``--broker NAME=HOST:PORT``; the expected ids
from the input dataset. Each (broker, queue) stream is read by its own Spark
task with ``XRANGE`` in pages, so the check scales with the data.

    python -m pipeline.verify --input /tmp/in --detour http://127.0.0.1:8080 --topic orders
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline import (  # noqa: E402
    add_token_argument,
    auth_headers,
    detour_token,
    ship_code,
    spark_session,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: Entries per XRANGE call.
PAGE = 1000
#: How many missing/duplicate ids a report lists.
SAMPLE = 20

FOUND_SCHEMA = "id string, broker string, queue_id int, entry string, error string"


@dataclass(frozen=True)
class BrokerRef:
    """Where a broker's streams are: ``host:port`` and how many queues it has."""

    name: str
    address: str
    queues: int


def brokers_from_detour(
    detour: str, topic: str, timeout_s: float = 5.0, token: str | None = None
) -> list[BrokerRef]:
    """The topic's route from Detour; raises when a broker has no address.

    ``GET /routes`` is an admin call: ``token`` (None: no header) must be an admin's
    when Detour has tokens.
    """
    import httpx

    r = httpx.get(f"{detour.rstrip('/')}/routes/{topic}", headers=auth_headers(token),
                  timeout=timeout_s)
    r.raise_for_status()
    refs = []
    for b in r.json()["brokers"]:
        if not b.get("address"):
            raise ValueError(f"route {topic!r} has no address for {b['brokerName']}")
        refs.append(BrokerRef(b["brokerName"], b["address"], int(b["writeQueueNums"])))
    return refs


def read_stream(
    broker: BrokerRef, topic: str, queue_id: int, timeout_s: float = 5.0
) -> Iterator[tuple[Any, ...]]:
    """Every entry of one stream as ``(id, broker, queue_id, entry, None)``; a broker that
    does not answer yields one ``(None, broker, queue_id, None, error)`` row instead."""
    import redis

    from pipeline.brokers import no_retry, stream_key

    host, _, port = broker.address.rpartition(":")
    key = stream_key(topic, queue_id)
    client = redis.Redis(host=host, port=int(port), socket_timeout=timeout_s,
                         socket_connect_timeout=timeout_s, retry=no_retry(),
                         decode_responses=True)
    try:
        length = int(client.xlen(key))
        start = "-"
        for _ in range(length // PAGE + 2):  # bounded: XLEN pages, plus one to see the end
            page = client.xrange(key, min=start, max="+", count=PAGE)
            if not page:
                break
            for entry_id, fields in page:
                yield ((fields or {}).get("id"), broker.name, queue_id, str(entry_id), None)
            start = f"({page[-1][0]!s}"
    except redis.RedisError as exc:
        yield (None, broker.name, queue_id, None, f"{type(exc).__name__}: {exc}")
    finally:
        client.close()


def read_brokers(spark: SparkSession, brokers: Sequence[BrokerRef], topic: str) -> DataFrame:
    """Every message of ``topic`` on every broker: ``(id, broker, queue_id, entry, error)``."""
    ship_code(spark)
    tasks = [(b, q) for b in brokers for q in range(b.queues)]
    rdd = spark.sparkContext.parallelize(tasks, max(1, len(tasks))).flatMap(
        lambda t: read_stream(t[0], topic, t[1])
    )
    return spark.createDataFrame(rdd, FOUND_SCHEMA)


@dataclass
class Verification:
    """The outcome: ``ok`` when no expected id is missing and every broker answered."""

    expected: int
    messages: int
    present: int
    missing: int
    duplicated_ids: int
    extra_copies: int
    unexpected: int
    per_broker: dict[str, int]
    unreachable: dict[str, str] = field(default_factory=dict)
    missing_sample: list[str] = field(default_factory=list)
    duplicate_sample: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.missing == 0 and not self.unreachable

    def table(self) -> str:
        lines = [
            f"expected ids         {self.expected}",
            f"messages on brokers  {self.messages}",
            f"present              {self.present}",
            f"missing (lost)       {self.missing}"
            + (f"  e.g. {', '.join(self.missing_sample[:5])}" if self.missing else ""),
            f"duplicated ids       {self.duplicated_ids} ({self.extra_copies} extra copies, "
            "at-least-once)",
            f"unexpected ids       {self.unexpected}",
            "per broker           "
            + ", ".join(f"{b}: {n}" for b, n in sorted(self.per_broker.items())),
        ]
        for b, err in sorted(self.unreachable.items()):
            lines.append(f"UNREACHABLE          {b}: {err}")
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def verify(
    spark: SparkSession, expected: DataFrame, brokers: Sequence[BrokerRef], topic: str
) -> Verification:
    """Compare the ``id`` column of ``expected`` with what the brokers hold."""
    from pyspark.sql import functions as F

    found = read_brokers(spark, brokers, topic).cache()
    try:
        errors = found.where(F.col("error").isNotNull()).select("broker", "error").collect()
        messages = found.where(F.col("error").isNull())
        counts = messages.groupBy("id").count()
        ids = expected.select(F.col("id").cast("string").alias("id")).distinct()
        joined = (
            ids.withColumn("expected", F.lit(True)).join(counts, "id", "full_outer").cache()
        )
        exp, n = F.col("expected").isNotNull(), F.col("count")
        row = joined.agg(
            F.count(F.when(exp, 1)).alias("expected"),
            F.coalesce(F.sum(n), F.lit(0)).alias("messages"),
            F.count(F.when(exp & n.isNotNull(), 1)).alias("present"),
            F.count(F.when(exp & n.isNull(), 1)).alias("missing"),
            F.count(F.when(n > 1, 1)).alias("dups"),
            F.coalesce(F.sum(F.when(n > 1, n - 1)), F.lit(0)).alias("extra"),
            F.count(F.when(~exp, 1)).alias("unexpected"),
        ).first()
        assert row is not None

        def sample(cond: Any) -> list[str]:
            rows = joined.where(cond).select("id").orderBy("id").limit(SAMPLE).collect()
            return [r["id"] for r in rows]

        result = Verification(
            expected=int(row["expected"]),
            messages=int(row["messages"]),
            present=int(row["present"]),
            missing=int(row["missing"]),
            duplicated_ids=int(row["dups"]),
            extra_copies=int(row["extra"]),
            unexpected=int(row["unexpected"]),
            per_broker={r["broker"]: int(r["count"])
                        for r in messages.groupBy("broker").count().collect()},
            unreachable={r["broker"]: r["error"] for r in errors},
            missing_sample=sample(exp & n.isNull()) if row["missing"] else [],
            duplicate_sample=sample(n > 1) if row["dups"] else [],
        )
        joined.unpersist()
        return result
    finally:
        found.unpersist()


def main(argv: Sequence[str] | None = None) -> int:
    from pipeline.produce import read_input

    p = argparse.ArgumentParser(prog="python -m pipeline.verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="the dataset that was produced")
    p.add_argument("--format", default="auto", choices=("auto", "parquet", "json", "csv"))
    p.add_argument("--topic", required=True)
    p.add_argument("--detour", default=None, help="read the brokers from the topic's route")
    p.add_argument("--broker", action="append", default=[], metavar="NAME=HOST:PORT",
                   help="a broker (repeatable) instead of --detour")
    p.add_argument("--queues", type=int, default=4, help="queues per --broker (default 4)")
    p.add_argument("--master", default=None)
    add_token_argument(p, "admin")
    args = p.parse_args(argv)
    if args.broker:
        brokers = [BrokerRef(n, a, args.queues)
                   for n, _, a in (b.partition("=") for b in args.broker)]
    elif args.detour:
        brokers = brokers_from_detour(args.detour, args.topic, token=detour_token(args.token))
    else:
        p.error("give --detour or --broker")
    spark = spark_session("detour-verify", args.master, {"spark.ui.showConsoleProgress": "false"})
    try:
        result = verify(spark, read_input(spark, args.input, args.format), brokers, args.topic)
        print(result.table())
        print(json.dumps({**asdict(result), "ok": result.ok}, sort_keys=True))
    finally:
        spark.stop()
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
