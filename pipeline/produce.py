"""The producing job: send every record of a dataset to a broker Detour chooses, on Spark.

Why Spark, and one Detour client per partition: a batch producer runs as many
concurrent producers as it has tasks, on many executors. That is exactly the
case Detour exists for: the first task that fails on a dead broker reports it,
and every other task (on any executor) avoids that broker from then on, instead
of each finding out by failing once. Each partition opens its own
``DetourClient`` (cached mode by default: selects decided in-process from a
replica the event stream keeps current) and sends each record with the SDK's
RocketMQ retry loop (``DetourClient.send``): select with the previous attempt's
broker, deliver, report every attempt, an exception as an isolation.

Delivering is an ``XADD`` to stream ``<topic>:<queueId>`` on the broker's
address (from the route registered in Detour), through a redis-py client per
address with ~200 ms socket timeouts (a SIGSTOPped broker times out instead of
hanging the task) and redis-py's own retries off (the send loop retries, on
another broker). Reports carry ``producer`` = ``<run>/<host>/<executor>/p<partition>``:
``<run>`` is the run's id (``--run-id``, or one made at start), so
``pipeline.export_log --run <out>`` exports this run's reports and no other's.

Each record's outcome (id, broker, queue, attempts, status, timings) is written
as Parquet to ``--out``, one file per partition, and read back for the summary
(never recomputed: sending has side effects). Delivery is at-least-once: a send
that timed out may still land when the broker wakes, and a retried Spark task
sends its partition again; ``pipeline.verify`` counts duplicates apart.

Run it::

    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master 'local[*]' \\
        pipeline/produce.py --input /tmp/in --detour http://127.0.0.1:8080 \\
        --topic orders --out /tmp/out

    .venv/bin/python -m pipeline.produce --input /tmp/in --detour http://127.0.0.1:8080 \\
        --topic orders --out /tmp/out [--mode remote] [--partitions 8]

A Detour with tokens needs a producer token: ``DETOUR_TOKEN`` (or ``--token``),
read on the driver and shipped to the executors inside ``ProduceOptions``, so
the executors need no environment of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import add_token_argument, announce, detour_token, ship_code, spark_session
from pipeline.progress import Progress, ProgressAddress, ProgressSender, task_attempt

if TYPE_CHECKING:
    import redis
    from pyspark.accumulators import Accumulator
    from pyspark.sql import DataFrame, Row, SparkSession

    from detour.client import SelectedQueue

#: Columns of the per-record result (Spark DDL).
RESULT_SCHEMA = (
    "id string, status string, broker string, queue_id int, attempts int, "
    "failed_attempts int, failed_brokers array<string>, avoided int, decision string, "
    "local_select boolean, latency_ms double, started_at long, sent_at long, "
    "producer string, partition int, error string"
)

#: Counters summed over every partition's DetourClient.
STAT_KEYS = ("remote_selects", "local_selects", "detour_failures", "sent_reports",
             "dropped_reports")

_PRODUCER_CHARS = re.compile(r"[^A-Za-z0-9_.:@%|/-]")
_RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,48}")


@dataclass(frozen=True)
class ProduceOptions:
    """Everything a partition needs to send: plain values, pickled to the executors."""

    detour: str
    topic: str
    mode: str = "cached"
    #: seconds per call to Detour, extra attempts per record, seconds per record.
    timeout: float = 0.2
    retries: int = 2
    deadline: float = 3.0
    #: socket timeouts of the broker clients, seconds.
    broker_timeout: float = 0.2
    #: records per second per partition, 0 = as fast as it goes.
    rate: float = 0.0
    #: seconds a partition waits for its client to be ready (cached: the first snapshot).
    ready_timeout: float = 10.0
    #: seconds the client may take to flush its last reports on close.
    flush_timeout: float = 5.0
    #: This run's id, the first part of every report's producer ("": ``produce`` makes one).
    run_id: str = ""
    #: Detour token (role producer) for every partition's client; None: no Authorization
    #: header. Travels to the executors with the options; kept out of repr (logs).
    token: str | None = field(default=None, repr=False)


def new_run_id() -> str:
    """``run-<UTC time>-<4 hex>``: sortable, readable, and unique enough to scope a log."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"run-{stamp}-{secrets.token_hex(2)}"


def run_id_arg(text: str) -> str:
    """``--run-id``: one segment of the producer id, so ``A-Za-z0-9_.-`` only (argparse)."""
    if not _RUN_ID.fullmatch(text):
        raise argparse.ArgumentTypeError("a run id is 1-48 of A-Za-z0-9_.-")
    return text


def producer_id(partition: int, run_id: str = "") -> str:
    """``<run>/<host>/<executor>/p<partition>``: who reported, as Detour's latency log
    records it (the run first, so a cut at 128 characters keeps it)."""
    executor = os.environ.get("SPARK_EXECUTOR_ID") or os.environ.get(
        "SPARK_EXECUTOR_POD_NAME", "local"
    )
    raw = f"{socket.gethostname()}/{executor}/p{partition}"
    if run_id:
        raw = f"{run_id}/{raw}"
    return _PRODUCER_CHARS.sub("_", raw)[:128]


class Deliverer:
    """``deliver(queue, (id, payload))`` for the send loop: XADD on the queue's broker.

    One redis-py client per broker address, created on first use and kept for
    the partition; a timed-out connection is dropped by redis-py and reopened by
    the next call.
    """

    def __init__(self, topic: str, timeout_s: float) -> None:
        self.topic = topic
        self.timeout_s = timeout_s
        self._clients: dict[str, redis.Redis] = {}

    def client(self, address: str) -> redis.Redis:
        c = self._clients.get(address)
        if c is None:
            import redis

            from pipeline.brokers import no_retry

            host, _, port = address.rpartition(":")
            c = redis.Redis(
                host=host, port=int(port), socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s, retry=no_retry(),
                health_check_interval=0,
            )
            self._clients[address] = c
        return c

    def __call__(self, queue: SelectedQueue, record: tuple[str, str]) -> str:
        from pipeline.brokers import stream_key

        if queue.address is None:
            raise LookupError(f"route has no address for {queue.broker_name}")
        rid, payload = record
        entry = self.client(queue.address).xadd(
            stream_key(self.topic, queue.queue_id), {"id": rid, "payload": payload}
        )
        return entry.decode() if isinstance(entry, bytes) else str(entry)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()


def _client_kwargs(opts: ProduceOptions, producer: str) -> dict[str, Any]:
    """The DetourClient settings; ``producer`` goes with every report to the latency log."""
    return {
        "timeout": opts.timeout, "mode": opts.mode, "retries": opts.retries,
        "deadline": opts.deadline, "producer": producer, "token": opts.token,
    }


def send_partition(
    index: int,
    rows: Iterable[Row],
    opts: ProduceOptions,
    stats: Accumulator[dict[str, int]] | None = None,
    progress: ProgressAddress | None = None,
) -> Iterator[tuple[Any, ...]]:
    """Send one partition's records; yields one result tuple (``RESULT_SCHEMA``) per record.

    ``progress``: where the driver's progress line listens (records sent, failed
    attempts and the brokers the last select passed over, a few times a second).
    """
    from detour.client import DetourClient, DetourClientError, SendError

    producer = producer_id(index, opts.run_id)
    deliver = Deliverer(opts.topic, opts.broker_timeout)
    client = DetourClient(opts.detour, **_client_kwargs(opts, producer))
    interval_ns = int(1e9 / opts.rate) if opts.rate > 0 else 0
    next_ns = time.monotonic_ns()
    sender = ProgressSender(progress, index, task_attempt())
    sent = failed_so_far = 0
    avoiding: tuple[str, ...] = ()
    try:
        client.wait_ready(opts.ready_timeout)
        for row in rows:
            if interval_ns:
                pause = (next_ns - time.monotonic_ns()) / 1e9
                if pause > 0:
                    time.sleep(pause)  # pacing to --rate, not synchronisation
                next_ns = max(next_ns + interval_ns, time.monotonic_ns() - interval_ns)
            rid, payload = str(row["id"]), str(row["payload"])
            started = time.time_ns()
            t0 = time.monotonic_ns()
            attempts: list[Any] = []
            status, error = "delivered", None
            try:
                result = client.send(opts.topic, (rid, payload), deliver)
                attempts = list(result.attempts)
            except SendError as exc:
                attempts, status, error = list(exc.attempts), "failed", repr(exc.__cause__)
            except DetourClientError as exc:  # not even one attempt could start
                status, error = "failed", repr(exc)
            latency = (time.monotonic_ns() - t0) / 1e6
            last = attempts[-1].queue if attempts else None
            failed = [a for a in attempts if a.error is not None]
            sent += 1
            failed_so_far += len(failed)
            if last is not None:
                avoiding = tuple(last.avoided_brokers)
            sent_ms = time.time_ns() // 1_000_000
            sender.update(sent, failed_so_far, avoiding, span_ms=(started // 1_000_000, sent_ms))
            yield (
                rid, status,
                None if last is None else last.broker_name,
                None if last is None else last.queue_id,
                len(attempts), len(failed), [a.queue.broker_name for a in failed],
                sum(1 for a in attempts if a.queue.avoided_brokers),
                None if last is None else str(last.decision),
                None if last is None else bool(last.local),
                latency, started // 1_000_000, sent_ms,
                producer, index, error,
            )
    finally:
        sender.update(sent, failed_so_far, avoiding, final=True)
        sender.close()
        deliver.close()
        # close() flushes what is pending, waiting out the client's backoff if Detour
        # was slow, for at most flush_timeout.
        client.close(flush_timeout=opts.flush_timeout)
        if stats is not None:
            s = client.stats()
            stats.add({k: int(getattr(s, k)) for k in STAT_KEYS})


def load_input(
    spark: SparkSession, path: str, fmt: str = "auto", json_schema: str | None = None
) -> DataFrame:
    """The input as Spark reads it: Parquet, JSON lines or CSV (with a header), ``auto`` by
    file suffix; raises ``ValueError`` when it has no ``id`` column.

    ``json_schema``: read JSON with this schema (DDL) instead of inferring one, which
    reads the whole input once more.
    """
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "parquet":
        df = spark.read.parquet(path)
    elif fmt == "json":
        reader = spark.read if json_schema is None else spark.read.schema(json_schema)
        df = reader.json(path)
    elif fmt == "csv":
        df = spark.read.option("header", True).csv(path)
    else:
        raise ValueError(f"unknown input format {fmt!r}")
    if "id" not in df.columns:
        raise ValueError(f"input {path} has no 'id' column (columns: {df.columns})")
    return df


def read_input(spark: SparkSession, path: str, fmt: str = "auto") -> DataFrame:
    """The records to send: ``id`` and ``payload`` (a ``payload`` column as is, otherwise
    the whole row as JSON)."""
    from pyspark.sql import functions as F

    df = load_input(spark, path, fmt)
    payload = (
        F.col("payload").cast("string") if "payload" in df.columns
        else F.to_json(F.struct(*[F.col(c) for c in df.columns]))
    )
    return df.select(F.col("id").cast("string").alias("id"), payload.alias("payload"))


def detect_format(path: str) -> str:
    """``parquet``/``json``/``csv`` from a local path's (or its data files') suffix."""
    suffixes = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
    p = Path(path)
    candidates = [p] if p.is_file() else sorted(
        f for f in p.glob("*") if f.is_file() and not f.name.startswith(("_", "."))
    )[:100] if p.is_dir() else []
    for f in candidates:
        for suffix, fmt in suffixes.items():
            if f.name.endswith(suffix) or f.name.endswith(suffix + ".gz"):
                return fmt
    raise ValueError(f"cannot tell the format of {path}: pass --format parquet|json|csv")


class _SumDict:
    """AccumulatorParam for dicts of counters (executors add, the driver reads)."""

    def zero(self, value: dict[str, int]) -> dict[str, int]:
        return dict.fromkeys(value, 0)

    def addInPlace(self, a: dict[str, int], b: dict[str, int]) -> dict[str, int]:  # noqa: N802
        for k, v in b.items():
            a[k] = a.get(k, 0) + v
        return a


@dataclass
class Summary:
    """What a run did; ``per_broker`` counts delivered records per broker."""

    records: int
    delivered: int
    retried: int
    failed: int
    failed_attempts: int
    avoided_selections: int
    per_broker: dict[str, int]
    failed_per_broker: dict[str, int]
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    send_seconds: float
    records_per_s: float
    wall_seconds: float = 0.0
    client: dict[str, int] = field(default_factory=dict)
    #: The run (``ProduceOptions.run_id``) and its first and last send, epoch ms on the
    #: executors' clocks: what ``pipeline.export_log --run`` scopes the log to.
    run_id: str = ""
    started_ms: int = 0
    ended_ms: int = 0

    def table(self) -> str:
        lines = [
            f"run                  {self.run_id or '-'}",
            f"records              {self.records}",
            f"delivered            {self.delivered}",
            f"retried              {self.retried}",
            f"failed               {self.failed}",
            f"failed attempts      {self.failed_attempts}",
            f"avoided selections   {self.avoided_selections}",
            f"send p50/p99/p99.9/max ms  {self.p50_ms:.2f} / {self.p99_ms:.2f} / "
            f"{self.p999_ms:.2f} / {self.max_ms:.2f}",
            f"records/s            {self.records_per_s:.0f} ({self.send_seconds:.2f} s sending, "
            f"{self.wall_seconds:.2f} s job)",
            "per broker           "
            + ", ".join(f"{b}: {n}" for b, n in sorted(self.per_broker.items())),
            "failed attempts on   "
            + (", ".join(f"{b}: {n}" for b, n in sorted(self.failed_per_broker.items()))
               or "-"),
        ]
        if self.client:
            lines.append("clients              "
                         + ", ".join(f"{k}={v}" for k, v in self.client.items()))
        return "\n".join(lines)


def summarize(results: DataFrame) -> Summary:
    """Aggregate a results DataFrame (``RESULT_SCHEMA``), read back from the output dir."""
    from pyspark.sql import functions as F

    agg = results.agg(
        F.count("*").alias("records"),
        F.sum(F.when(F.col("status") == "delivered", 1).otherwise(0)).alias("delivered"),
        F.sum(F.when(F.col("attempts") > 1, 1).otherwise(0)).alias("retried"),
        F.sum(F.when(F.col("status") == "failed", 1).otherwise(0)).alias("failed"),
        F.sum("failed_attempts").alias("failed_attempts"),
        F.sum("avoided").alias("avoided"),
        F.percentile("latency_ms", F.lit(0.5)).alias("p50"),
        F.percentile("latency_ms", F.lit(0.99)).alias("p99"),
        F.percentile("latency_ms", F.lit(0.999)).alias("p999"),
        F.max("latency_ms").alias("max"),
        F.min("started_at").alias("first"),
        F.max("sent_at").alias("last"),
    ).first()
    assert agg is not None
    per_broker = {
        r["broker"]: int(r["count"])
        for r in results.where(F.col("status") == "delivered").groupBy("broker").count().collect()
    }
    failed_per_broker = {
        r["b"]: int(r["count"])
        for r in results.select(F.explode("failed_brokers").alias("b")).groupBy("b")
        .count().collect()
    }
    records = int(agg["records"] or 0)
    span = max(0.001, ((agg["last"] or 0) - (agg["first"] or 0)) / 1000) if records else 0.0
    return Summary(
        records=records,
        delivered=int(agg["delivered"] or 0),
        retried=int(agg["retried"] or 0),
        failed=int(agg["failed"] or 0),
        failed_attempts=int(agg["failed_attempts"] or 0),
        avoided_selections=int(agg["avoided"] or 0),
        per_broker=per_broker,
        failed_per_broker=failed_per_broker,
        p50_ms=float(agg["p50"] or 0.0),
        p99_ms=float(agg["p99"] or 0.0),
        p999_ms=float(agg["p999"] or 0.0),
        max_ms=float(agg["max"] or 0.0),
        send_seconds=span,
        records_per_s=records / span if span else 0.0,
        started_ms=int(agg["first"] or 0),
        ended_ms=int(agg["last"] or 0),
    )


def produce(
    spark: SparkSession,
    records: DataFrame,
    opts: ProduceOptions,
    out: str,
    partitions: int | None = None,
    progress: Progress | None = None,
) -> Summary:
    """Send ``records`` (``id``, ``payload``) through Detour; write results to ``out``.

    ``partitions``: repartition first (None keeps the input's). ``progress``: the
    driver's progress line (its total is counted from ``records`` first: one more
    read of the input). Returns the summary, also written as ``out/_summary.json``
    (Spark skips ``_`` files).
    """
    if not opts.run_id:
        opts = replace(opts, run_id=new_run_id())
    ship_code(spark)
    sc = spark.sparkContext
    stats = sc.accumulator(dict.fromkeys(STAT_KEYS, 0), _SumDict())  # type: ignore[arg-type]
    if partitions:
        records = records.repartition(partitions)
    address = None
    if progress is not None:
        progress.say("counting the input's records")
        progress.set_total(records.count())
        progress.say(f"sending {progress.total:,} records, run {opts.run_id}")
        address = progress.address

    def run(index: int, rows: Iterable[Row]) -> Iterator[tuple[Any, ...]]:
        return send_partition(index, rows, opts, stats, address)

    sent = records.rdd.mapPartitionsWithIndex(run)
    started = time.monotonic()
    with progress if progress is not None else nullcontext():
        spark.createDataFrame(sent, RESULT_SCHEMA).write.mode("overwrite").parquet(out)
    wall = time.monotonic() - started
    summary = summarize(spark.read.parquet(out))
    summary.wall_seconds = wall
    summary.run_id = opts.run_id
    summary.client = dict(stats.value)
    write_summary(out, summary)
    return summary


def write_summary(out: str, summary: Summary) -> None:
    """``out/_summary.json`` when ``out`` is a local path (elsewhere: printed only)."""
    if "://" in out and not out.startswith("file://"):
        return
    path = Path(out.removeprefix("file://")) / "_summary.json"
    path.write_text(json.dumps(asdict(summary), indent=2, sort_keys=True))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.produce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="dataset with an 'id' column")
    p.add_argument("--format", default="auto", choices=("auto", "parquet", "json", "csv"))
    p.add_argument("--detour", default="http://127.0.0.1:8080", help="Detour's URL")
    p.add_argument("--topic", required=True)
    p.add_argument("--out", required=True, help="results directory (Parquet)")
    p.add_argument("--mode", default="cached", choices=("cached", "remote"))
    p.add_argument("--partitions", type=int, default=None, help="repartition the input first")
    p.add_argument("--timeout", type=float, default=0.2, help="seconds per Detour call")
    p.add_argument("--retries", type=int, default=2, help="extra attempts per record")
    p.add_argument("--deadline", type=float, default=3.0, help="seconds for all attempts")
    p.add_argument("--broker-timeout", type=float, default=0.2, help="broker socket timeout, s")
    p.add_argument("--rate", type=float, default=0.0, help="records/s per partition (0: no cap)")
    p.add_argument("--run-id", default=None, type=run_id_arg,
                   help="this run's id, in every report's producer (default: run-<time>-<hex>)")
    p.add_argument("--master", default=None, help="default: spark-submit's, else local[*]")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a live progress line on stderr (default on)")
    add_token_argument(p, "producer")
    return p


def options(args: argparse.Namespace) -> ProduceOptions:
    """The job's options from its command line; the token from ``--token`` or ``DETOUR_TOKEN``."""
    return ProduceOptions(
        detour=args.detour, topic=args.topic, mode=args.mode, timeout=args.timeout,
        retries=args.retries, deadline=args.deadline, broker_timeout=args.broker_timeout,
        rate=args.rate, run_id=args.run_id or "", token=detour_token(args.token),
    )


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    args = _parser().parse_args(argv)
    opts = options(args)
    spark = spark_session("detour-produce", args.master,
                          {"spark.ui.showConsoleProgress": "false"})
    announce(spark, "produce")
    progress = Progress("produce", "records", spark.sparkContext,
                        failures="failed attempts") if args.progress else None
    try:
        summary = produce(spark, read_input(spark, args.input, args.format), opts, args.out,
                          args.partitions, progress)
        out(summary.table())
        out(json.dumps(asdict(summary), sort_keys=True))
    finally:
        spark.stop()
    return 0 if summary.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
