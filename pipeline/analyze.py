"""Analyse an exported latency log: what the brokers did, what Detour did about it, what to tune.

Why: Detour's tiers (``latencyMax`` -> ``notAvailableDuration``) are RocketMQ's
defaults, tuned for brokers whose normal send takes tens of ms. A deployment
should see how its brokers actually behave and what the tiers cost it before
changing them. From the Parquet written by ``pipeline.export_log`` this job
computes, per broker and time window:

* latency percentiles (p50/p90/p99, max) of successful sends and the number of
  isolations (failed sends); a failure's latency is the time to fail, not a
  send latency, so it is left out of the percentiles;
* the time the broker was avoided, by replaying the tier rules over its reports
  with ``detour.strategy`` (the service's own code: duration by top-down tier
  scan, window end extended with ``max`` unless ``lastReportWins``);
* the selects that would have been avoided under other tier tables: each
  report is one send, whose select happened at ``at - latencyMs``; a select is
  avoided under a table when the reports before it, replayed with that table,
  leave the broker's window open. Counted as failures that would have been
  spared and successful sends that would have been diverted. First order only:
  the same reports are replayed, without the traffic a table would have moved.
  Under the table Detour ran these are the sends that got through anyway (near 0);
* the selects each table's windows moved to other brokers, which the log cannot
  show (a moved send is logged under the broker it went to): estimated per send
  as the share of the other brokers avoided when it was selected
  (``moved_elsewhere``);

and recommends a tier table from the observed latency distribution (the rule,
also in docs/spark.md). RocketMQ's table reads: up to 100 ms is normal (tiers
50 and 100, 0 s), 5.5x that opens the first window (550 ms, 30 s), and so on up
to 15 s (600 s), with failures counted as 30 s. The recommendation keeps that
shape and moves it to where this fleet's normal is, scale ``s = f * q99 / 100 ms``
(q99 of successful sends, like q50 read at the latency log's bucket resolution,
``log_resolution``: most reports reach the log as histograms):

* ``latencyMax`` = [q50, then RocketMQ's 100 ... 15000 ms times ``s``] (whole
  ms, strictly increasing), plus one tier at ``isolationLatencyMs`` for failures;
* ``notAvailableDuration`` = RocketMQ's durations times ``s``, never below 1 s
  (shorter is noise next to the 1 s replica sync) nor above RocketMQ's; 0 for
  the two normal tiers; the failure tier keeps RocketMQ's 600 s (a dead broker
  is no faster to come back on a fast network);
* ``f`` is the smallest of 1, 2, 4, ... 2048 at which replaying this log
  diverts at most 1 % of the successful sends more than the failure tier alone
  does (a table whose only tier is the failure one). Why: how often a healthy broker
  crosses a tier depends on its send rate, not only on the distribution; at
  thousands of sends per second even a 0.01 % tail opens windows all the time,
  and the replay measures exactly that.

Outputs in ``--out``: ``report.md`` (tables), ``latency.png`` (percentiles and max of
successful sends, failed sends on a band above, injected faults from ``--faults``),
``avoided.png``, ``histogram.png`` (matplotlib, Agg backend), ``windows.csv`` and
``analysis.json`` (everything, machine-readable).

    python -m pipeline.analyze --log /tmp/latency.parquet --out /tmp/report \\
        [--window 60] [--detour http://127.0.0.1:8080] [--tiers fast=50,100,200:0,0,5000] \\
        [--faults /tmp/faults.jsonl]

``--detour`` reads ``GET /config``: against a Detour with tokens, an admin token in
``DETOUR_TOKEN`` (or ``--token``).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import datetime as dt
import json
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detour import strategy
from detour.model import (
    DEFAULT_LATENCY_MAX,
    DEFAULT_NOT_AVAILABLE_DURATION,
    LATENCY_BUCKETS,
    Config,
)
from pipeline import (
    add_token_argument,
    auth_headers,
    detour_token,
    ship_code,
    spark_session,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: Percentiles reported per broker and window.
PERCENTILES = (0.5, 0.9, 0.99)
#: Percentiles of the pooled distribution shown with the recommendation.
RULE_PERCENTILES = (0.5, 0.9, 0.99, 0.999)
#: RocketMQ's top "normal" tier (ms): q99 takes its place.
RMQ_NORMAL_MS = 100
#: Window for failures in the recommended table (RocketMQ's top duration, ms).
FAILURE_WINDOW_MS = 600_000
#: Scale factors tried for the recommendation, smallest first.
FACTORS = tuple(2**k for k in range(12))
#: Most successful sends the recommended table may divert, as a fraction of them.
DIVERT_BUDGET = 0.01
#: Shortest window the recommendation gives an avoiding tier (ms).
MIN_AVOID_MS = 1000
#: Successful sends below which q99 is a guess (the report says so).
MIN_SAMPLES = 1000
#: Where the report's command sends the config change when ``--detour`` names none.
DEFAULT_DETOUR = "http://127.0.0.1:8080"
#: Windows listed in report.md (windows.csv has them all).
MAX_REPORT_ROWS = 60
#: Window lengths (s) ``--window`` picks from when not given, and how many windows the
#: log's span is cut into at most: enough points per line, enough reports per point.
NICE_WINDOWS_S = (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600,
                  7200, 21600, 43200, 86400)
TARGET_WINDOWS = 30


def auto_window_s(span_ms: int) -> float:
    """The shortest of ``NICE_WINDOWS_S`` that cuts ``span_ms`` into ``TARGET_WINDOWS`` at most.

    Why: one fixed default fits no run; 60 s windows over a 6 s run give every broker
    one point, and 1 s windows over a day give 86,400.
    """
    want = span_ms / 1000 / TARGET_WINDOWS
    return next((w for w in NICE_WINDOWS_S if w >= want), NICE_WINDOWS_S[-1])


@dataclass(frozen=True)
class TierTable:
    """A fault-strategy tier table to replay: Detour's config fields under a name."""

    name: str
    latency_max: tuple[int, ...] = DEFAULT_LATENCY_MAX
    durations: tuple[int, ...] = DEFAULT_NOT_AVAILABLE_DURATION
    isolation_latency_ms: int = 30000
    last_report_wins: bool = False

    def config(self) -> Config:
        """The service's Config (validates: same length, strictly increasing, >= 0)."""
        return Config(
            send_latency_fault_enable=True,
            latency_max=tuple(self.latency_max),
            not_available_duration=tuple(self.durations),
            isolation_latency_ms=self.isolation_latency_ms,
            last_report_wins=self.last_report_wins,
        )

    def body(self) -> dict[str, Any]:
        """The ``PATCH /config`` body that installs this table (a merge patch: the other
        settings stay)."""
        return {
            "sendLatencyFaultEnable": True,
            "latencyMax": list(self.latency_max),
            "notAvailableDuration": list(self.durations),
            "isolationLatencyMs": self.isolation_latency_ms,
            "lastReportWins": self.last_report_wins,
        }

    @classmethod
    def from_body(cls, name: str, body: dict[str, Any]) -> TierTable:
        """From a ``GET /config`` answer (omitted fields: Detour's defaults)."""
        return cls(
            name,
            tuple(int(x) for x in body.get("latencyMax", DEFAULT_LATENCY_MAX)),
            tuple(int(x) for x in body.get("notAvailableDuration",
                                           DEFAULT_NOT_AVAILABLE_DURATION)),
            int(body.get("isolationLatencyMs", 30000)),
            bool(body.get("lastReportWins", False)),
        )

    @classmethod
    def parse(cls, text: str) -> TierTable:
        """``NAME=L1,L2,...:D1,D2,...`` (ms), e.g. ``fast=50,100,200:0,0,5000``."""
        name, _, spec = text.partition("=")
        lat, _, dur = spec.partition(":")
        if not name or not lat or not dur:
            raise ValueError(f"bad tier table {text!r}: want NAME=L1,L2,...:D1,D2,...")
        table = cls(name, tuple(int(x) for x in lat.split(",")),
                    tuple(int(x) for x in dur.split(",")))
        table.config()  # raises ValueError when invalid
        return table


ROCKETMQ = TierTable("rocketmq")


def log_resolution(q: float) -> float:
    """``q`` at the latency log's resolution: the upper bound of its ``LATENCY_BUCKETS``
    bucket (above the last bound, ``q`` itself).

    Why: most reports reach the log as per-bucket counts (docs/semantics.md), so a
    percentile is known to its bucket, not to the ms. Reading it so from either form of the
    log makes the recommendation the same from the histograms as from every report.
    """
    i = bisect.bisect_right(LATENCY_BUCKETS, q)
    return float(LATENCY_BUCKETS[i]) if i < len(LATENCY_BUCKETS) else q


def pick(
    candidates: Sequence[TierTable],
    totals: dict[str, dict[str, Any]],
    successes: int,
    baseline: TierTable,
) -> TierTable:
    """The smallest factor's table whose replay diverts at most ``DIVERT_BUDGET`` of the
    successful sends more than the failure tier alone does (the last one otherwise)."""
    budget = DIVERT_BUDGET * successes + totals[baseline.name]["avoided_ok"]
    return next((c for c in candidates if totals[c.name]["avoided_ok"] <= budget),
                candidates[-1])


def percentile(sorted_values: Sequence[int], p: float) -> float:
    """Spark's ``percentile`` (exact, linear between the two nearest ranks), in process."""
    n = len(sorted_values)
    pos = p * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def recommend_in_process(
    reports: Sequence[tuple[str, int, int, bool]], current: TierTable = ROCKETMQ
) -> TierTable:
    """The table ``analyze`` recommends for ``(broker, at_ms, latency_ms, isolation)``
    reports, computed in this process with the job's own steps (``log_resolution``,
    ``recommend``, ``replay``, ``pick``): for logs small enough not to need Spark, and to
    compare two forms of one log (tests/test_log_histograms.py)."""
    ok = sorted(r[2] for r in reports if not r[3])
    q50, q99 = (percentile(ok, 0.5), percentile(ok, 0.99)) if ok else (1.0, 1.0)
    candidates = [
        recommend(log_resolution(q50), log_resolution(q99), current.isolation_latency_ms, f)
        for f in FACTORS
    ]
    baseline = TierTable("failures-only", (current.isolation_latency_ms,),
                         (FAILURE_WINDOW_MS,), current.isolation_latency_ms)
    start, end = min(r[1] for r in reports), max(r[1] for r in reports) + 1
    by_broker: dict[str, list[tuple[int, int, bool]]] = {}
    for broker, at, latency, isolation in reports:
        by_broker.setdefault(broker, []).append((at, latency, isolation))
    totals = {}
    for table in (baseline, *candidates):
        rows = [asdict(w) for rs in by_broker.values()
                for w in replay(rs, table, end - start, start, end).values()]
        totals[table.name] = _totals(table, rows)
    return pick(candidates, totals, len(ok), baseline)


def recommend(
    q50: float, q99: float, isolation_latency_ms: int = 30000, factor: float = 1.0
) -> TierTable:
    """The table RocketMQ's shape gives at scale ``factor * q99 / 100 ms`` (see the module doc).

    Named ``x<factor>``; ``analyze`` picks the factor by replaying the log.
    """
    # q99 of at least 1 ms (whole-ms latencies); at most 24 s, where RocketMQ's 15 s tier
    # would pass the 3,600,000 ms a tier may be.
    q50 = max(0.0, q50)
    scale = min(max(1.0, q99) * factor, 24_000.0) / RMQ_NORMAL_MS
    raw = [min(q50, DEFAULT_LATENCY_MAX[1] * scale),
           *(lat * scale for lat in DEFAULT_LATENCY_MAX[1:])]
    latency: list[int] = []
    for x in raw:
        v = max(0, math.ceil(x - 1e-9))
        latency.append(v if not latency else max(v, latency[-1] + 1))
    durations: list[int] = []
    for d in DEFAULT_NOT_AVAILABLE_DURATION:
        v = 0 if d == 0 else min(d, max(MIN_AVOID_MS, round(d * scale)))
        durations.append(v if not durations else max(v, durations[-1]))
    if latency[-1] < isolation_latency_ms:
        latency.append(isolation_latency_ms)
        durations.append(FAILURE_WINDOW_MS)
    else:  # a fleet this slow: failures share the top tier, which gets the failure window
        durations[-1] = FAILURE_WINDOW_MS
        isolation_latency_ms = latency[-1]
    return TierTable(f"x{factor:g}", tuple(latency), tuple(durations), isolation_latency_ms)


# -- the replay (pure) ----------------------------------------------------------------------


@dataclass
class WindowReplay:
    """One broker's window under one table: time avoided, selects, and which were avoided."""

    avoided_ms: int = 0
    selects: int = 0
    avoided_selects: int = 0
    avoided_failures: int = 0
    avoided_ok: int = 0


def window_of(t_ms: int, window_ms: int) -> int:
    return t_ms // window_ms * window_ms


def _add_span(windows: dict[int, WindowReplay], a: int, b: int, window_ms: int) -> None:
    t = a
    for _ in range((b - a) // window_ms + 2):  # bounded: the windows [a, b) spans
        if t >= b:
            return
        ws = window_of(t, window_ms)
        e = min(b, ws + window_ms)
        windows.setdefault(ws, WindowReplay()).avoided_ms += e - t
        t = e


def replay(
    reports: Iterable[tuple[int, int, bool]],
    table: TierTable,
    window_ms: int,
    start_ms: int,
    end_ms: int,
) -> dict[int, WindowReplay]:
    """One broker's ``(at_ms, latency_ms, isolation)`` reports replayed under ``table``.

    Returns per window start: the ms the broker was avoided within
    ``[start_ms, end_ms)`` and, for each report's select (at ``at - latency``),
    whether the window left by the reports before it was open.
    """
    config = table.config()
    rs = sorted(reports)
    ats = [r[0] for r in rs]
    ends: list[int] = []
    end: int | None = None
    for at, latency, isolation in rs:
        duration = strategy.report_duration(config, latency, isolation)
        end = strategy.updated_available_at(end, at, duration, config.last_report_wins)
        ends.append(end)
    windows: dict[int, WindowReplay] = {}
    for i, (at, _, _) in enumerate(rs):
        nxt = ats[i + 1] if i + 1 < len(rs) else end_ms
        a, b = max(at, start_ms), min(ends[i], nxt, end_ms)
        if b > a:
            _add_span(windows, a, b, window_ms)
    for j, (at, latency, isolation) in enumerate(rs):
        w = windows.setdefault(window_of(at, window_ms), WindowReplay())
        w.selects += 1
        selected_at = at - latency
        k = min(bisect.bisect_right(ats, selected_at) - 1, j - 1)
        if k >= 0 and selected_at < ends[k]:
            w.avoided_selects += 1
            if isolation:
                w.avoided_failures += 1
            else:
                w.avoided_ok += 1
    return windows


def avoided_spans(
    reports: Iterable[tuple[int, int, bool]], table: TierTable, start_ms: int, end_ms: int
) -> list[tuple[int, int]]:
    """One broker's avoided time under ``table``, as ``replay`` counts it: merged
    ``[from, to)`` spans (epoch ms) within ``[start_ms, end_ms)``, in order."""
    config = table.config()
    rs = sorted(reports)
    spans: list[tuple[int, int]] = []
    end: int | None = None
    for i, (at, latency, isolation) in enumerate(rs):
        duration = strategy.report_duration(config, latency, isolation)
        end = strategy.updated_available_at(end, at, duration, config.last_report_wins)
        nxt = rs[i + 1][0] if i + 1 < len(rs) else end_ms
        a, b = max(at, start_ms), min(end, nxt, end_ms)
        if b <= a:
            continue
        if spans and spans[-1][1] >= a:
            spans[-1] = (spans[-1][0], max(spans[-1][1], b))
        else:
            spans.append((a, b))
    return spans


def in_spans(spans: Sequence[tuple[int, int]], t_ms: int) -> bool:
    """Whether ``t_ms`` falls in one of ``spans`` (sorted, merged)."""
    i = bisect.bisect_right(spans, (t_ms, math.inf)) - 1
    return i >= 0 and spans[i][0] <= t_ms < spans[i][1]


def moved_elsewhere(
    sends: Iterable[tuple[str, int]],
    spans: dict[str, list[tuple[int, int]]],
    brokers: int,
) -> float:
    """How many sends the windows in ``spans`` kept off their brokers: sends that are
    *not* in the log under the avoided broker, because they went elsewhere. Estimated from
    the ones that are.

    Each logged send ``(broker, selected_at)`` was one select; when ``k`` other brokers
    of the ``brokers`` were avoided at that moment, round-robin without avoidance (every
    broker the same number of queues) would have sent ``k / brokers`` of such selects to
    them. Summed over sends. Not ``pipeline.produce``'s "avoided selections" (selects
    whose walk passed over an avoided broker): one walk steps over all of a broker's
    queues and moves the counter past them, so fewer selects cross an avoided broker than
    would have landed on it.
    """
    if brokers <= 0:
        return 0.0
    total = 0
    for broker, selected_at in sends:
        total += sum(1 for b, s in spans.items()
                     if b != broker and in_spans(s, selected_at))
    return total / brokers


def _replay_rows(
    broker: str,
    reports: Iterable[tuple[int, int, bool]],
    tables: Sequence[TierTable],
    window_ms: int,
    start_ms: int,
    end_ms: int,
) -> Iterator[tuple[Any, ...]]:
    rs = list(reports)
    for table in tables:
        for ws, w in sorted(replay(rs, table, window_ms, start_ms, end_ms).items()):
            yield (table.name, broker, ws, w.avoided_ms, w.selects, w.avoided_selects,
                   w.avoided_failures, w.avoided_ok)


REPLAY_SCHEMA = (
    "tier_table string, broker string, window_start long, avoided_ms long, selects long, "
    "avoided_selects long, avoided_failures long, avoided_ok long"
)


def _totals(table: TierTable, rows: Sequence[Any]) -> dict[str, Any]:
    return {
        "name": table.name, **table.body(),
        "selects": sum(int(r["selects"]) for r in rows),
        "avoided_selects": sum(int(r["avoided_selects"]) for r in rows),
        "avoided_failures": sum(int(r["avoided_failures"]) for r in rows),
        "avoided_ok": sum(int(r["avoided_ok"]) for r in rows),
        "avoided_ms": sum(int(r["avoided_ms"]) for r in rows),
    }


# -- the Spark job --------------------------------------------------------------------------


def _moved_elsewhere_by_table(
    spark: SparkSession,
    df: DataFrame,
    grouped: Any,
    tables: Sequence[TierTable],
    brokers: int,
    start_ms: int,
    end_ms: int,
) -> dict[str, float]:
    """``moved_elsewhere`` per table, over the whole log: each broker's avoided spans are
    replayed where its reports are (one list of spans per broker and table comes back),
    then every send is looked up against them in one pass."""
    rows = grouped.flatMap(
        lambda kv: [(t.name, kv[0], avoided_spans(kv[1], t, start_ms, end_ms)) for t in tables]
    ).collect()
    spans: dict[str, dict[str, list[tuple[int, int]]]] = {t.name: {} for t in tables}
    for name, broker, s in rows:
        if s:
            spans[name][broker] = s
    shared = spark.sparkContext.broadcast(spans)
    names = [t.name for t in tables]

    def one(r: Any) -> tuple[float, ...]:
        send = [(str(r[0]), int(r[1]) - int(r[2]))]
        return tuple(moved_elsewhere(send, shared.value[n], brokers) for n in names)

    zero = tuple(0.0 for _ in names)
    sums = df.select("broker", "at_ms", "latency_ms").rdd.map(one).fold(
        zero, lambda x, y: tuple(a + b for a, b in zip(x, y, strict=True))
    )
    shared.unpersist()
    return {n: round(v, 1) for n, v in zip(names, sums, strict=True)}


@dataclass
class Analysis:
    """Everything the report shows; ``windows``/``brokers``/``tables`` are lists of plain dicts."""

    reports: int
    start_ms: int
    end_ms: int
    window_ms: int
    current: str
    pooled: dict[str, float]
    successes: int
    windows: list[dict[str, Any]]
    brokers: list[dict[str, Any]]
    tables: list[dict[str, Any]]
    recommendation: dict[str, Any]
    candidates: list[dict[str, Any]] = field(default_factory=list)
    histogram: list[tuple[int, int]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    #: Faults injected during the run (``--faults``): ``{"at_ms", "action", "broker"}``.
    faults: list[dict[str, Any]] = field(default_factory=list)
    #: The Detour the report's command changes the config of (``--detour``).
    detour: str = DEFAULT_DETOUR

    def broker(self, name: str) -> dict[str, Any]:
        return next(b for b in self.brokers if b["broker"] == name)

    def window(self, broker: str, start_ms: int) -> dict[str, Any]:
        return next(w for w in self.windows
                    if w["broker"] == broker and w["window_start"] == start_ms)

    def table(self, name: str) -> dict[str, Any]:
        return next(t for t in self.tables if t["name"] == name)


def load(spark: SparkSession, path: str) -> DataFrame:
    """The exported log: ``broker, latency_ms, isolation, producer, at_ms``."""
    return spark.read.parquet(path).select("broker", "latency_ms", "isolation", "producer",
                                           "at_ms")


def _pcts(col: Any, ps: Sequence[float]) -> Any:
    from pyspark.sql import functions as F

    return F.percentile(col, list(ps))


def _stats(df: DataFrame, keys: Sequence[str]) -> list[dict[str, Any]]:
    from pyspark.sql import functions as F

    ok = F.when(~F.col("isolation"), F.col("latency_ms"))
    rows = df.groupBy(*keys).agg(
        F.count("*").alias("reports"),
        F.sum(F.col("isolation").cast("int")).alias("isolations"),
        _pcts(ok, PERCENTILES).alias("p"),
        F.max(ok).alias("max"),
        F.avg(ok).alias("mean"),
    ).collect()
    out = []
    for r in rows:
        p = r["p"] or [None] * len(PERCENTILES)
        d = {k: r[k] for k in keys}
        d.update(reports=int(r["reports"]), isolations=int(r["isolations"] or 0),
                 p50=p[0], p90=p[1], p99=p[2], max=r["max"], mean=r["mean"])
        out.append(d)
    return sorted(out, key=lambda d: tuple(d[k] for k in keys))


def analyze(
    spark: SparkSession,
    log_path: str,
    window_s: float | None = None,
    current: TierTable = ROCKETMQ,
    alternatives: Sequence[TierTable] = (),
    out: str | Path | None = None,
    faults: Sequence[dict[str, Any]] = (),
    detour: str = "",
) -> Analysis:
    """Analyse the latency log at ``log_path``; write the report to ``out`` when given.

    ``window_s``: the window length; None derives it from the log's span
    (``auto_window_s``). ``faults``: what was injected when (``read_faults``), marked on
    the plots.
    """
    from pyspark.sql import functions as F

    ship_code(spark)
    df = load(spark, log_path).cache()
    grouped: Any = None
    try:
        span = df.agg(F.count("*").alias("n"), F.min("at_ms").alias("a"),
                      F.max("at_ms").alias("b")).first()
        assert span is not None
        n = int(span["n"])
        if n == 0:
            raise ValueError(f"the latency log at {log_path} is empty")
        start_ms, end_ms = int(span["a"]), int(span["b"]) + 1
        if window_s is None:
            window_s = auto_window_s(end_ms - start_ms)
        window_ms = max(1, int(window_s * 1000))
        with_window = df.withColumn("window_start",
                                    F.floor(F.col("at_ms") / window_ms) * window_ms)
        windows = _stats(with_window, ("broker", "window_start"))
        brokers = _stats(df, ("broker",))

        ok = df.where(~F.col("isolation"))
        prow = ok.agg(F.count("*").alias("n"),
                      _pcts(F.col("latency_ms"), RULE_PERCENTILES).alias("p")).first()
        assert prow is not None
        successes = int(prow["n"])
        q = prow["p"] if successes else [1.0, 1.0, 1.0, 1.0]
        pooled = {"p50": q[0], "p90": q[1], "p99": q[2], "p999": q[3]}
        candidates = [recommend(log_resolution(q[0]), log_resolution(q[2]),
                                current.isolation_latency_ms, f) for f in FACTORS]
        baseline = TierTable("failures-only", (current.isolation_latency_ms,),
                             (FAILURE_WINDOW_MS,), current.isolation_latency_ms)
        tables: list[TierTable] = []
        for t in (current, ROCKETMQ, baseline, *candidates, *alternatives):
            if all(t.name != x.name for x in tables):
                tables.append(t)
        grouped = df.select("broker", "at_ms", "latency_ms", "isolation").rdd.map(
            lambda r: (r[0], (int(r[1]), int(r[2]), bool(r[3])))
        ).groupByKey().cache()
        replayed = spark.createDataFrame(
            grouped.flatMap(lambda kv: _replay_rows(kv[0], kv[1], tables, window_ms, start_ms,
                                                    end_ms)),
            REPLAY_SCHEMA,
        ).collect()

        by_key = {(r["tier_table"], r["broker"], r["window_start"]): r for r in replayed}
        for w in windows:
            r = by_key.get((current.name, w["broker"], w["window_start"]))
            w["avoided_ms"] = int(r["avoided_ms"]) if r else 0
        # Windows with avoided time but no report (a broker avoided, so not sent to).
        seen = {(w["broker"], w["window_start"]) for w in windows}
        for r in replayed:
            if r["tier_table"] == current.name and (r["broker"], r["window_start"]) not in seen:
                windows.append({"broker": r["broker"], "window_start": r["window_start"],
                                "reports": 0, "isolations": 0, "p50": None, "p90": None,
                                "p99": None, "max": None, "mean": None,
                                "avoided_ms": int(r["avoided_ms"])})
        windows.sort(key=lambda w: (w["broker"], w["window_start"]))
        for b in brokers:
            b["avoided_ms"] = sum(int(r["avoided_ms"]) for r in replayed
                                  if r["tier_table"] == current.name
                                  and r["broker"] == b["broker"])
            b["avoided_pct"] = 100.0 * b["avoided_ms"] / (end_ms - start_ms)
        totals = {t.name: _totals(t, [r for r in replayed if r["tier_table"] == t.name])
                  for t in tables}
        chosen = pick(candidates, totals, successes, baseline)
        # What the log cannot show by itself: the selects each shown table's windows moved
        # to other brokers (they are not in the log: they went elsewhere), estimated.
        shown_tables = list({t.name: t for t in (current, ROCKETMQ, chosen, *alternatives)}
                            .values())
        moved = _moved_elsewhere_by_table(spark, df, grouped, shown_tables, len(brokers),
                                          start_ms, end_ms)
        recommended = {**totals[chosen.name], "name": "recommended", "factor": chosen.name,
                       "moved_selects": moved[chosen.name]}
        shown = [current.name, ROCKETMQ.name, *(t.name for t in alternatives)]
        table_rows = [{**totals[name], "moved_selects": moved[name]}
                      for name in dict.fromkeys(shown)]
        table_rows.insert(2 if current.name != ROCKETMQ.name else 1, recommended)

        buckets = ok.groupBy(F.floor(F.log2(F.col("latency_ms") + 1)).alias("b")).count()
        histogram = sorted((int(r["b"]), int(r["count"])) for r in buckets.collect())
        result = Analysis(
            reports=n, start_ms=start_ms, end_ms=end_ms, window_ms=window_ms,
            current=current.name, pooled=pooled, successes=successes, windows=windows,
            brokers=brokers, tables=table_rows,
            recommendation={k: recommended[k] for k in ("name", "factor", *chosen.body())},
            candidates=[totals[c.name] for c in (baseline, *candidates)],
            histogram=histogram,
            faults=[dict(f) for f in faults],
            detour=(detour or DEFAULT_DETOUR).rstrip("/"),
        )
    finally:
        df.unpersist()
        if grouped is not None:
            grouped.unpersist()
    if out is not None:
        write_report(result, Path(out))
    return result


# -- the report -----------------------------------------------------------------------------


def _iso(ms: int, millis: bool = False) -> str:
    """UTC wall time; ``millis`` for windows shorter than a second (else they repeat)."""
    t = dt.datetime.fromtimestamp(ms / 1000, dt.UTC)
    return t.strftime("%Y-%m-%d %H:%M:%S") + (f".{ms % 1000:03d}" if millis else "")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(a: Analysis) -> str:
    """The report's Markdown: brokers, windows, tier tables, the recommendation."""
    rec = a.recommendation
    parts = [
        "# Detour latency analysis",
        "",
        f"{a.reports} reports from {_iso(a.start_ms)} to {_iso(a.end_ms)} UTC, "
        f"windows of {a.window_ms / 1000:g} s; avoided time replayed with the "
        f"`{a.current}` tier table.",
        "",
        "## Brokers",
        "",
        _md_table(
            ["broker", "reports", "isolations", "p50 ms", "p90 ms", "p99 ms", "max ms",
             "avoided s", "avoided %"],
            ([b["broker"], b["reports"], b["isolations"], _ms(b["p50"]), _ms(b["p90"]),
              _ms(b["p99"]), _ms(b["max"]), f"{b['avoided_ms'] / 1000:.1f}",
              f"{b['avoided_pct']:.1f}"] for b in a.brokers),
        ),
        "",
        "## Windows",
        "",
        _md_table(
            ["broker", "window (UTC)", "reports", "isolations", "p50 ms", "p99 ms", "max ms",
             "avoided s"],
            ([w["broker"], _iso(w["window_start"], a.window_ms % 1000 != 0), w["reports"],
              w["isolations"],
              _ms(w["p50"]), _ms(w["p99"]), _ms(w["max"]), f"{w['avoided_ms'] / 1000:.1f}"]
             for w in a.windows[:MAX_REPORT_ROWS]),
        ),
    ]
    if len(a.windows) > MAX_REPORT_ROWS:
        parts += ["", f"({len(a.windows) - MAX_REPORT_ROWS} more windows in windows.csv)"]
    parts += [
        "",
        "## Tier tables replayed",
        "",
        "The log holds the sends that happened; a send Detour kept from an avoided broker "
        "went to another one, so it is in the log under that broker, and nothing in the log "
        "says it was moved. Two counts per table, then:",
        "",
        "- **moved elsewhere (est.)**: sends the table's windows kept off avoided brokers. "
        "Each logged send's select (at `at - latencyMs`) counts the share of the brokers "
        "avoided at that moment (replayed under the table) other than its own: the part of "
        "it round-robin without avoidance would have sent to them. (`pipeline.produce`'s "
        "avoided selections count something narrower: selects whose walk passed over an "
        "avoided broker, about a third of these with 4 brokers and one avoided.)",
        "- **sent into a window**: logged sends whose select fell in a window that earlier "
        "reports opened under the table, split into failed and successful sends. Under the "
        f"table Detour ran (`{a.current}`) they are the sends that got through anyway (a "
        "select before the window reached its producer): near 0 is Detour working, not "
        "Detour idle. Under another table they are what it would have spared (the failures) "
        "and diverted (the successes), first order: the same sends replayed.",
        "",
        _md_table(
            ["table", "latencyMax ms", "notAvailableDuration ms", "sends",
             "moved elsewhere (est.)", "sent into a window", "of them failed",
             "of them succeeded", "avoided s (all brokers)"],
            ([t["name"], ", ".join(map(str, t["latencyMax"])),
              ", ".join(map(str, t["notAvailableDuration"])), t["selects"],
              f"{t.get('moved_selects', 0):,.0f}", t["avoided_selects"],
              t["avoided_failures"], t["avoided_ok"],
              f"{t['avoided_ms'] / 1000:.1f}"] for t in a.tables),
        ),
        "",
        "## Recommendation",
        "",
        f"Successful sends: {a.successes}; p50 {a.pooled['p50']:.1f} ms, p90 "
        f"{a.pooled['p90']:.1f} ms, p99 {a.pooled['p99']:.1f} ms, p99.9 "
        f"{a.pooled['p999']:.1f} ms.",
        "",
        f"Rule (s = f x q99 / 100 ms, here f = {rec['factor'].lstrip('x')}): `latencyMax` = "
        "[q50, RocketMQ's 100 ... 15000 ms x s, isolationLatencyMs]; `notAvailableDuration` "
        "= RocketMQ's durations x s, at least 1 s and at most RocketMQ's, 0 for the two "
        "normal tiers, 600 s for failures; f is the smallest power of two (1 to 2048) at "
        f"which the replay diverts at most {DIVERT_BUDGET:.0%} of successful sends more than "
        "the failure tier alone.",
        "",
    ]
    if a.successes < MIN_SAMPLES:
        parts += [f"**Only {a.successes} successful sends: q99 is a guess; collect at "
                  f"least {MIN_SAMPLES} before applying this.**", ""]
    body = {k: v for k, v in rec.items() if k not in ("name", "factor")}
    # A merge patch: only the tiers change, every other setting stays as it is. An admin
    # call: the token comes from DETOUR_TOKEN when it is set.
    parts += ["```sh", f"curl -X PATCH {a.detour}/config "
              "${DETOUR_TOKEN:+-H \"Authorization: Bearer $DETOUR_TOKEN\"} \\",
              "  -H 'content-type: application/merge-patch+json' \\",
              f"  -d '{json.dumps(body)}'", "```", "",
              "![latency](latency.png)", "", "![avoided](avoided.png)", "",
              "![histogram](histogram.png)", ""]
    return "\n".join(parts)


def avoided_bars(a: Analysis) -> dict[str, list[tuple[float, float, float]]]:
    """Each broker's bars in avoided.png: ``(x, width, percent of the window avoided)``.

    x is seconds after the log's first report. Each window is clipped to the log's
    span and its brokers' bars sit side by side inside it, so a bar is drawn where
    its time is, however long the window.
    """
    names = sorted({w["broker"] for w in a.windows})
    span_s = (a.end_ms - a.start_ms) / 1000
    window_s = a.window_ms / 1000
    starts = sorted({w["window_start"] for w in a.windows})
    bars: dict[str, list[tuple[float, float, float]]] = {}
    for i, name in enumerate(names):
        by = {w["window_start"]: w["avoided_ms"] for w in a.windows if w["broker"] == name}
        bars[name] = []
        for start in starts:
            offset = (start - a.start_ms) / 1000
            lo, hi = max(0.0, offset), min(span_s, offset + window_s)
            if hi <= lo:
                continue
            slot = (hi - lo) / len(names)
            bars[name].append((lo + i * slot, slot * 0.9,
                               100.0 * by.get(start, 0) / ((hi - lo) * 1000)))
    return bars


def read_faults(path: Path) -> list[dict[str, Any]]:
    """The faults a run injected, from the JSON lines ``pipeline.brokers start --events``
    writes (or its printed output: ``{"fault": {...}}`` lines; other lines are skipped):
    ``{"at_ms", "action", "broker"}`` each, in time order."""
    faults = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            body = json.loads(line)
        except ValueError:
            continue
        event = body.get("fault", body) if isinstance(body, dict) else None
        if isinstance(event, dict) and {"at_ms", "action", "broker"} <= set(event) \
                and not event.get("error"):
            faults.append({k: event[k] for k in ("at_ms", "action", "broker")})
    return sorted(faults, key=lambda f: int(f["at_ms"]))


@dataclass(frozen=True)
class LatencySeries:
    """One broker's marks in latency.png; x is seconds after the log's first report."""

    #: (x, p50, p99, max) of each window with successful sends, at the window's middle
    points: list[tuple[float, float, float, float]]
    #: (x, failed sends) of each window with failures, successful sends or not
    failures: list[tuple[float, int]]


def latency_series(a: Analysis) -> dict[str, LatencySeries]:
    """What latency.png draws per broker: percentiles where sends succeeded, and failures
    where they failed, so a broker whose sends all fail has marks instead of a line that
    just stops."""
    span_s = (a.end_ms - a.start_ms) / 1000
    window_s = a.window_ms / 1000
    out = {}
    for name in sorted({w["broker"] for w in a.windows}):
        points, failures = [], []
        for w in sorted((w for w in a.windows if w["broker"] == name),
                        key=lambda w: int(w["window_start"])):
            lo = (w["window_start"] - a.start_ms) / 1000
            x = (max(0.0, lo) + min(span_s, lo + window_s)) / 2
            if w["p99"] is not None:
                points.append((x, float(w["p50"]), float(w["p99"]), float(w["max"])))
            if w["isolations"]:
                failures.append((x, int(w["isolations"])))
        out[name] = LatencySeries(points, failures)
    return out


def fault_marks(a: Analysis) -> list[tuple[float, str]]:
    """(x, label) of each injected fault inside the log's span, x seconds after its start."""
    span_s = (a.end_ms - a.start_ms) / 1000
    marks = []
    for f in a.faults:
        x = (int(f["at_ms"]) - a.start_ms) / 1000
        if 0 <= x <= span_s:
            marks.append((x, f"{f['action']} {f['broker']}"))
    return marks


def _mark_faults(ax: Any, a: Analysis, top: float) -> None:
    for x, label in fault_marks(a):
        ax.axvline(x, color="black", linestyle=":", linewidth=1, gid="fault")
        ax.text(x, top, f" {label}", rotation=90, va="top", ha="right", fontsize=7,
                gid="fault-label")


def latency_figure(a: Analysis) -> Any:
    """latency.png's figure: per broker p99 (line), p50 (dashed) and max (open triangles)
    of successful sends per window; failed sends as crosses on a band above them, with
    their count; injected faults as dotted vertical lines. The y range has room above
    every mark, so none is clipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    span_s = (a.end_ms - a.start_ms) / 1000
    window_s = a.window_ms / 1000
    series = latency_series(a)
    ceiling = max([1.0] + [p[3] for s in series.values() for p in s.points])
    band = ceiling * 3  # failed sends: above every latency
    top = ceiling * 20  # symlog: room above the band for its counts and the fault labels
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for name, s in series.items():
        xs = [p[0] for p in s.points]
        line = ax.plot(xs, [p[2] for p in s.points], marker=".", label=f"{name} p99",
                       clip_on=False)
        color = line[0].get_color()
        ax.plot(xs, [p[1] for p in s.points], linestyle="--", color=color, alpha=0.6,
                label=f"{name} p50", clip_on=False)
        ax.scatter(xs, [p[3] for p in s.points], marker="^", s=16, facecolors="none",
                   edgecolors=color, clip_on=False, gid=f"max:{name}")
        if s.failures:
            ax.scatter([f[0] for f in s.failures], [band] * len(s.failures), marker="x",
                       color=color, clip_on=False, gid=f"failures:{name}",
                       label=f"{name} failed sends")
            for x, n in s.failures:
                ax.annotate(str(n), (x, band), textcoords="offset points", xytext=(0, 5),
                            ha="center", fontsize=7, color=color)
    ax.axhline(band, color="0.85", linewidth=0.8, zorder=0, gid="failure-band")
    ax.text(0.005, band, "failed sends", ha="left", va="bottom", fontsize=7, color="0.4",
            transform=ax.get_yaxis_transform())
    _mark_faults(ax, a, top)
    ax.set_xlim(0, max(span_s, window_s))
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(0, top)
    ax.set_xlabel(f"seconds after {_iso(a.start_ms)} UTC ({window_s:g} s windows)")
    ax.set_ylabel("latency of successful sends (ms)")
    ax.set_title("Send latency per window (p99, p50 dashed, max triangles); failures; "
                 "faults dotted", fontsize=10)
    ax.legend(fontsize=7, ncol=3, loc="upper left", bbox_to_anchor=(0, -0.15))
    fig.tight_layout()
    return fig


def plot(a: Analysis, out: Path) -> list[Path]:
    """latency.png, avoided.png, histogram.png (matplotlib, Agg: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    # Time on the x axis is seconds after the log's first report, every window drawn where
    # it lies, clipped to the log's span (the first and last windows are partial).
    span_s = (a.end_ms - a.start_ms) / 1000
    window_s = a.window_ms / 1000
    xlabel = f"seconds after {_iso(a.start_ms)} UTC ({window_s:g} s windows)"

    fig = latency_figure(a)
    files.append(out / "latency.png")
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, bars in avoided_bars(a).items():
        ax.bar([b[0] for b in bars], [b[2] for b in bars], width=[b[1] for b in bars],
               label=name, align="edge")
    _mark_faults(ax, a, 100)
    ax.set_xlim(0, max(span_s, window_s))
    ax.set_ylim(0, 100)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("% of the window avoided")
    ax.set_title(f"Time each broker was avoided ({a.current} tiers, replayed); faults dotted")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(out / "avoided.png")
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    if a.histogram:
        ax.bar([2 ** b - 1 for b, _ in a.histogram], [c for _, c in a.histogram],
               width=[2 ** b for b, _ in a.histogram], align="edge", color="0.6",
               label="successful sends")
    for t in a.tables:
        if t["name"] in (a.current, "recommended"):
            style = "-" if t["name"] == "recommended" else ":"
            for lat in t["latencyMax"]:
                ax.axvline(lat, linestyle=style,
                           color="tab:red" if style == "-" else "tab:blue", alpha=0.7)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_yscale("log")
    ax.set_xlabel("latency (ms); tiers: recommended (red), current (blue, dotted)")
    ax.set_ylabel("sends")
    ax.set_title("Latency distribution and tier boundaries")
    fig.tight_layout()
    files.append(out / "histogram.png")
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)
    return files


def write_report(a: Analysis, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    files = plot(a, out)
    (out / "report.md").write_text(markdown(a))
    with open(out / "windows.csv", "w", newline="") as f:
        cols = ["broker", "window_start", "reports", "isolations", "p50", "p90", "p99", "max",
                "mean", "avoided_ms"]
        writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(a.windows)
    a.files = [str(p) for p in (*files, out / "report.md", out / "windows.csv",
                                out / "analysis.json")]
    (out / "analysis.json").write_text(json.dumps(asdict(a), indent=2, default=str))


def fetch_config(detour: str, token: str | None = None) -> TierTable:
    """Detour's current tiers (``GET /config``: an admin call when Detour has tokens)."""
    import httpx

    r = httpx.get(f"{detour.rstrip('/')}/config", headers=auth_headers(token), timeout=5)
    r.raise_for_status()
    return TierTable.from_body("current", r.json())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.analyze", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log", required=True, help="Parquet from pipeline.export_log")
    p.add_argument("--out", required=True, help="report directory")
    p.add_argument("--window", type=float, default=None,
                   help="window length, s (default: from the log's span, at most "
                        f"{TARGET_WINDOWS} windows)")
    p.add_argument("--detour", default=None, help="replay with this Detour's current config")
    p.add_argument("--config", type=Path, default=None, help="... or a config JSON file")
    p.add_argument("--tiers", action="append", default=[], metavar="NAME=L1,..:D1,..",
                   help="an alternative tier table to replay (repeatable)")
    p.add_argument("--faults", type=Path, default=None,
                   help="the run's injected faults, marked on the plots: the file "
                        "`pipeline.brokers start --events` wrote")
    p.add_argument("--master", default=None)
    add_token_argument(p, "admin")
    args = p.parse_args(argv)
    if args.detour:
        current = fetch_config(args.detour, detour_token(args.token))
    elif args.config:
        current = TierTable.from_body("current", json.loads(args.config.read_text()))
    else:
        current = ROCKETMQ
    alternatives = [TierTable.parse(t) for t in args.tiers]
    spark = spark_session("detour-analyze", args.master, {"spark.ui.showConsoleProgress": "false"})
    try:
        faults = read_faults(args.faults) if args.faults else []
        a = analyze(spark, args.log, args.window, current, alternatives, args.out, faults,
                    args.detour or "")
        print(markdown(a))
        print(f"report: {Path(args.out) / 'report.md'}")
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
