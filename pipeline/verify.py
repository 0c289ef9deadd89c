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
from the input dataset (its ``id`` column only). The (broker, queue) streams are
spread over about two tasks per core and read with ``XRANGE`` in pages, so the
check scales with the data; a progress line shows the entries read, their rate
and the time left (every stream's length is known when the reading starts).
What it costs, measured, is in docs/spark.md.

    python -m pipeline.verify --input /tmp/in --detour http://127.0.0.1:8080 --topic orders
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline import (
    add_token_argument,
    announce,
    auth_headers,
    detour_token,
    ship_code,
    spark_session,
)
from pipeline.progress import Progress, ProgressAddress, ProgressSender, task_attempt

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: Entries per XRANGE call.
PAGE = 1000
#: How many missing/duplicate ids a report lists.
SAMPLE = 20
#: Messages per shuffle partition of the comparison (with as many expected ids: about a
#: million rows of a short id each).
MESSAGES_PER_SHUFFLE_PARTITION = 500_000

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
    broker: BrokerRef, topic: str, queue_id: int, timeout_s: float = 5.0,
    on_page: Callable[[int], None] | None = None, length: int | None = None,
) -> Iterator[tuple[Any, ...]]:
    """Every entry of one stream as ``(id, broker, queue_id, entry, None)``; a broker that
    does not answer yields one ``(None, broker, queue_id, None, error)`` row instead.

    ``on_page(n)`` is told each page's size; ``length`` is the stream's ``XLEN`` when
    the caller has it (it bounds the pages read)."""
    import redis

    from pipeline.brokers import no_retry, stream_key

    host, _, port = broker.address.rpartition(":")
    key = stream_key(topic, queue_id)
    client = redis.Redis(host=host, port=int(port), socket_timeout=timeout_s,
                         socket_connect_timeout=timeout_s, retry=no_retry(),
                         decode_responses=True)
    try:
        if length is None:
            length = int(client.xlen(key))
        start = "-"
        for _ in range(length // PAGE + 2):  # bounded: XLEN pages, plus one to see the end
            page = client.xrange(key, min=start, max="+", count=PAGE)
            if not page:
                break
            for entry_id, fields in page:
                yield ((fields or {}).get("id"), broker.name, queue_id, str(entry_id), None)
            if on_page is not None:
                on_page(len(page))
            start = f"({page[-1][0]!s}"
    except redis.RedisError as exc:
        yield (None, broker.name, queue_id, None, f"{type(exc).__name__}: {exc}")
    finally:
        client.close()


def _lengths(
    streams: Sequence[tuple[BrokerRef, int]], topic: str, timeout_s: float = 5.0
) -> list[int | None]:
    """Each stream's XLEN (None when its broker does not answer: read_stream reports it)."""
    import redis

    from pipeline.brokers import no_retry, stream_key

    lengths: list[int | None] = []
    for broker, queue_id in streams:
        host, _, port = broker.address.rpartition(":")
        try:
            with redis.Redis(host=host, port=int(port), socket_timeout=timeout_s,
                             socket_connect_timeout=timeout_s, retry=no_retry()) as c:
                lengths.append(int(c.xlen(stream_key(topic, queue_id))))
        except redis.RedisError:
            lengths.append(None)
    return lengths


def read_streams(
    index: int,
    streams: Sequence[tuple[BrokerRef, int]],
    topic: str,
    progress: ProgressAddress | None = None,
) -> Iterator[tuple[Any, ...]]:
    """One task's share of the streams, one after the other; tells the progress line the
    entries it has read of the total its streams held when it started."""
    lengths = _lengths(streams, topic)
    sender = ProgressSender(progress, index, task_attempt())
    read = 0

    def on_page(n: int) -> None:
        nonlocal read
        read += n
        sender.update(read, total=total)

    total = sum(n or 0 for n in lengths)
    sender.update(0, total=total)
    try:
        for (broker, queue_id), length in zip(streams, lengths, strict=True):
            yield from read_stream(broker, topic, queue_id, on_page=on_page, length=length)
    finally:
        sender.update(read, total=total, final=True)
        sender.close()


def streams_of(brokers: Sequence[BrokerRef]) -> list[tuple[BrokerRef, int]]:
    return [(b, q) for b in brokers for q in range(b.queues)]


def read_brokers(
    spark: SparkSession,
    brokers: Sequence[BrokerRef],
    topic: str,
    progress: Progress | None = None,
    entries: int | None = None,
) -> DataFrame:
    """Every message of ``topic`` on every broker: ``(id, broker, queue_id, entry, error)``.

    About two tasks per core, each reading its streams in turn: a task per stream
    (16 for 4 brokers of 4 queues) spent more time being scheduled than reading.
    ``entries``: the streams' total length when the driver knows it (the progress
    line's total; otherwise the tasks tell it as they start).
    """
    ship_code(spark)
    streams = streams_of(brokers)
    slices = max(1, min(len(streams), 2 * spark.sparkContext.defaultParallelism))
    address = None
    if progress is not None:
        progress.set_total(entries)
        progress.parts = slices
        address = progress.address
    rdd = spark.sparkContext.parallelize(streams, slices).mapPartitionsWithIndex(
        lambda i, it: read_streams(i, list(it), topic, address)
    )
    # read_stream builds every row to FOUND_SCHEMA itself: checking each again in Python
    # cost a quarter of the read (100,000 entries: 1.8 s against 1.3 s, warm).
    return spark.createDataFrame(rdd, FOUND_SCHEMA, verifySchema=False)


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
    spark: SparkSession,
    expected: DataFrame,
    brokers: Sequence[BrokerRef],
    topic: str,
    progress: Progress | None = None,
) -> Verification:
    """Compare the ``id`` column of ``expected`` with what the brokers hold.

    ``progress``: the line shown while the streams are read (the comparison after
    it takes a few seconds more).
    """
    from pyspark.sql import functions as F

    # The total when the driver reaches the brokers (it usually does): for the progress
    # line and to size the comparison's shuffle.
    lengths = _lengths(streams_of(brokers), topic, timeout_s=1.0)
    entries = None if None in lengths else sum(n or 0 for n in lengths)
    if progress is not None:
        progress.say(f"reading {len(lengths)} streams of {len(brokers)} brokers"
                     + (f", {entries:,} entries" if entries is not None else ""))
    found = read_brokers(spark, brokers, topic, progress, entries).cache()
    per_id = None
    shuffle = _ShufflePartitions(spark, entries)
    try:
        with progress if progress is not None else nullcontext():
            errors = found.where(F.col("error").isNotNull()).select("broker", "error").collect()
        messages = found.where(F.col("error").isNull())
        # One shuffle: the expected ids and the messages' ids side by side, grouped once
        # (a distinct, a group-by and a join were three, each a stage of its own).
        per_id = (
            expected.select(F.col("id").cast("string").alias("id"),
                            F.lit(1).alias("e"), F.lit(0).alias("c"))
            .unionByName(messages.select("id", F.lit(0).alias("e"), F.lit(1).alias("c")))
            .groupBy("id")
            .agg(F.max("e").alias("e"), F.sum("c").alias("n"))
            .cache()
        )
        exp, n = F.col("e") == 1, F.col("n")
        row = per_id.agg(
            F.count(F.when(exp, 1)).alias("expected"),
            F.coalesce(F.sum(n), F.lit(0)).alias("messages"),
            F.count(F.when(exp & (n > 0), 1)).alias("present"),
            F.count(F.when(exp & (n == 0), 1)).alias("missing"),
            F.count(F.when(n > 1, 1)).alias("dups"),
            F.coalesce(F.sum(F.when(n > 1, n - 1)), F.lit(0)).alias("extra"),
            F.count(F.when(~exp, 1)).alias("unexpected"),
        ).first()
        assert row is not None

        def sample(cond: Any) -> list[str]:
            assert per_id is not None
            rows = per_id.where(cond).select("id").orderBy("id").limit(SAMPLE).collect()
            return [r["id"] for r in rows]

        return Verification(
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
            missing_sample=sample(exp & (n == 0)) if row["missing"] else [],
            duplicate_sample=sample(n > 1) if row["dups"] else [],
        )
    finally:
        shuffle.restore()
        if per_id is not None:
            per_id.unpersist()
        found.unpersist()


class _ShufflePartitions:
    """``spark.sql.shuffle.partitions`` in proportion to the data while ``verify`` runs.

    Why: Spark's default of 200 made the comparison of 8,000 ids spend seconds scheduling
    near-empty tasks (2 to 5 s against about 1 s at 4, measured on 2 cores). One
    partition per ``MESSAGES_PER_SHUFFLE_PARTITION`` messages, at least one per core. A
    value the user set (``--conf``) is left alone, and the session's is put back after.
    """

    def __init__(self, spark: SparkSession, messages: int | None) -> None:
        self.spark = spark
        self.previous: str | None = None
        key = "spark.sql.shuffle.partitions"
        if messages is None or spark.sparkContext.getConf().contains(key):
            return
        self.previous = spark.conf.get(key)
        wanted = max(spark.sparkContext.defaultParallelism,
                     -(-messages // MESSAGES_PER_SHUFFLE_PARTITION))
        spark.conf.set(key, str(wanted))

    def restore(self) -> None:
        if self.previous is not None:
            self.spark.conf.set("spark.sql.shuffle.partitions", self.previous)


def read_ids(spark: SparkSession, path: str, fmt: str = "auto") -> DataFrame:
    """The ``id`` column of the input, as strings, read without inferring a schema.

    Why not ``read_input``: a JSON input's schema is inferred by reading it all once
    more, and the payloads are not needed here.
    """
    from pyspark.sql import functions as F

    from pipeline.produce import load_input

    df = load_input(spark, path, fmt, json_schema="id string")
    return df.select(F.col("id").cast("string").alias("id"))


def main(argv: Sequence[str] | None = None) -> int:
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
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a live progress line on stderr (default on)")
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
    announce(spark, "verify")
    progress = Progress("verify", "entries read", spark.sparkContext) if args.progress else None
    try:
        result = verify(spark, read_ids(spark, args.input, args.format), brokers, args.topic,
                        progress)
        print(result.table())
        print(json.dumps({**asdict(result), "ok": result.ok}, sort_keys=True))
    finally:
        spark.stop()
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
