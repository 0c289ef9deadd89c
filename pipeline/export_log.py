"""Export Detour's latency log (``GET /latency-log``) to a Parquet file for the analysis job.

Why: the log is what producers reported (broker, latency, isolation, producer, time):
each report that opened, extended or ended a window or failed, and the rest as one
histogram per replica, broker and producer per flush (docs/semantics.md), which the
export expands into one row per report (``expand``) so the analysis reads one form.
It lives in a bounded Redis stream (``DETOUR_LATENCY_LOG_MAX``, default 100,000
entries, trimmed oldest first). Exporting it keeps a run's
evidence after the stream moves on, and Parquet is what Spark reads fastest.

Pages are read oldest first with ``after=<last id>`` and written one row group
per page through a ``ParquetWriter``, so memory stays at one page whatever the
log's size. The export stops at the first short or empty page (the log's end as
of then); ``--after`` resumes an earlier export. Plain Python with pyarrow: no
Spark needed for a single sequential reader.

The log is every run's: ``--run /tmp/out`` (a ``pipeline.produce`` output, whose
``_summary.json`` names the run and its first and last send) keeps only that
run's reports, the ones whose producer names its run id, and reads only the
part of the log around its time; ``--run <run id>`` does the same by id alone,
reading the whole log.

    python -m pipeline.export_log --detour http://127.0.0.1:8080 --out /tmp/latency.parquet \
        [--run /tmp/out]

``GET /latency-log`` is an admin call: a Detour with tokens needs an admin token
in ``DETOUR_TOKEN`` (or ``--token``); without one the export stops at the first
page with the 401 (403 for a producer token).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from detour.model import LATENCY_BUCKETS
from pipeline import add_token_argument, auth_headers, detour_token

#: The exported columns: the log entry, plus ``at`` as a timestamp for readers that want one.
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("broker", pa.string()),
        ("latency_ms", pa.int64()),
        ("isolation", pa.bool_()),
        ("producer", pa.string()),
        ("at_ms", pa.int64()),
        ("at", pa.timestamp("ms", tz="UTC")),
    ]
)

#: Largest page the endpoint serves.
MAX_PAGE = 10_000
#: Most entries one export reads (the log's own bound is 10,000,000).
MAX_ENTRIES = 10_000_000


@dataclass
class Export:
    rows: int
    pages: int
    first_id: str | None
    last_id: str | None
    out: str
    #: Entries read, kept or not (``rows`` when the export is not scoped to a run).
    scanned: int = 0
    run_id: str | None = None


@dataclass(frozen=True)
class RunScope:
    """One produce run's part of the log: entries whose producer has the run id as a segment.

    ``started_ms``/``ended_ms`` (the run's first and last send) only narrow what is
    read: the entries from ``SLACK_MS`` before the start to ``SLACK_MS`` after the end,
    for the clocks of executors and Redis to disagree and the last reports to be
    flushed after the last send.
    """

    run_id: str
    started_ms: int | None = None
    ended_ms: int | None = None

    SLACK_MS = 60_000

    @classmethod
    def parse(cls, text: str) -> RunScope:
        """A produce output directory (with ``_summary.json``) or a bare run id."""
        summary = Path(text) / "_summary.json"
        if summary.is_file():
            s = json.loads(summary.read_text())
            if not s.get("run_id"):
                raise ValueError(f"{summary} names no run (written before runs had ids)")
            return cls(str(s["run_id"]), int(s["started_ms"]) or None,
                       int(s["ended_ms"]) or None)
        if "/" in text or not text:
            raise ValueError(f"{text!r} is neither a produce output with _summary.json "
                             "nor a run id")
        return cls(text)

    def cursor(self) -> str | None:
        """Where to start reading: log ids are ``<ms>-<seq>``, in time order."""
        if self.started_ms is None:
            return None
        return f"{max(0, self.started_ms - self.SLACK_MS)}-0"

    def keep(self, entry: dict[str, Any]) -> bool:
        return self.run_id in str(entry.get("producer") or "").split("/")

    def past(self, entry: dict[str, Any]) -> bool:
        """True once the log has moved beyond the run (nothing of it can follow)."""
        return self.ended_ms is not None and int(entry["at"]) > self.ended_ms + self.SLACK_MS


def bucket_value(i: int) -> int:
    """The latency a histogram row gets for bucket ``i`` of ``LATENCY_BUCKETS``: the middle
    of the bucket (whole ms, inside it, so its tier is the one its reports had: the tier
    edges are bucket bounds); the open last bucket, its lower bound."""
    lo = LATENCY_BUCKETS[i]
    if i + 1 >= len(LATENCY_BUCKETS):
        return lo
    return (lo + LATENCY_BUCKETS[i + 1] - 1) // 2


def expand(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A log entry as rows of one report each: a histogram entry (one replica's quiet
    reports of one interval, docs/semantics.md) becomes one row per report it counts, at
    its bucket's middle, spread evenly over ``[since, at]`` in an order shuffled by the
    entry's id (deterministic), so the analysis's replay sees them mixed as they came."""
    counts = entry.get("histogram")
    if counts is None:
        return [entry]
    latencies = [bucket_value(i) for i, c in enumerate(counts) for _ in range(int(c))]
    random.Random(str(entry["id"])).shuffle(latencies)
    n = len(latencies)
    since, at = int(entry.get("since") or entry["at"]), int(entry["at"])
    return [
        {**entry, "latencyMs": lat, "isolation": False,
         "at": since + (at - since) * (2 * k + 1) // (2 * n)}
        for k, lat in enumerate(latencies)
    ]


def to_table(entries: Sequence[dict[str, Any]]) -> pa.Table:
    """Log entries (the endpoint's JSON) as a table with ``SCHEMA``, a histogram entry
    expanded into its reports (``expand``)."""
    entries = [row for e in entries for row in expand(e)]
    at = [int(e["at"]) for e in entries]
    return pa.table(
        {
            "id": [str(e["id"]) for e in entries],
            "broker": [str(e["brokerName"]) for e in entries],
            "latency_ms": [int(e["latencyMs"]) for e in entries],
            "isolation": [bool(e["isolation"]) for e in entries],
            "producer": [str(e.get("producer") or "") for e in entries],
            "at_ms": at,
            "at": pa.array(at, pa.int64()).cast(pa.timestamp("ms", tz="UTC")),
        },
        schema=SCHEMA,
    )


def export(
    detour: str,
    out: str | Path,
    after: str | None = None,
    page: int = MAX_PAGE,
    max_entries: int = MAX_ENTRIES,
    timeout_s: float = 10.0,
    transport: httpx.BaseTransport | None = None,
    token: str | None = None,
    scope: RunScope | None = None,
) -> Export:
    """Page through the log after ``after`` (None: from the start) into ``out``.

    ``token``: an admin token, sent as ``Authorization: Bearer`` (None: no header).
    ``scope``: keep one run's entries only (and start at its time unless ``after``).
    """
    if not 1 <= page <= MAX_PAGE:
        raise ValueError(f"page must be 1..{MAX_PAGE}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = pages = scanned = 0
    first: str | None = None
    cursor = after if after is not None or scope is None else scope.cursor()
    with (
        httpx.Client(base_url=detour.rstrip("/"), timeout=timeout_s, transport=transport,
                     headers=auth_headers(token)) as c,
        pq.ParquetWriter(out, SCHEMA) as writer,
    ):
        for _ in range(max_entries // page + 1):  # bounded by the most entries we will read
            params: dict[str, Any] = {"limit": page}
            if cursor is not None:
                params["after"] = cursor
            r = c.get("/latency-log", params=params)
            r.raise_for_status()
            body = r.json()
            entries = body["entries"]
            if not entries:
                break
            kept = entries if scope is None else [e for e in entries if scope.keep(e)]
            if kept:
                table = to_table(kept)
                writer.write_table(table)
                first = first or str(kept[0]["id"])
                rows += table.num_rows
            scanned += len(entries)
            pages += 1
            cursor = body["next"] or str(entries[-1]["id"])
            if len(entries) < page or (scope is not None and scope.past(entries[-1])):
                break
        if rows == 0:
            writer.write_table(SCHEMA.empty_table())
    return Export(rows, pages, first, cursor if scanned else after, str(out), scanned,
                  None if scope is None else scope.run_id)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.export_log", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--detour", default="http://127.0.0.1:8080")
    p.add_argument("--out", required=True, help="the Parquet file to write")
    p.add_argument("--after", default=None, help="resume after this log id")
    p.add_argument("--page", type=int, default=MAX_PAGE, help=f"entries per call (<= {MAX_PAGE})")
    p.add_argument("--run", default=None, metavar="OUT_DIR|RUN_ID",
                   help="only this produce run's reports: its --out directory or its run id")
    add_token_argument(p, "admin")
    args = p.parse_args(argv)
    try:
        scope = RunScope.parse(args.run) if args.run else None
    except ValueError as exc:
        p.error(str(exc))
    try:
        result = export(args.detour, args.out, args.after, args.page,
                        token=detour_token(args.token), scope=scope)
    except httpx.HTTPStatusError as exc:
        # 401/403: no admin token; the answer's body says which.
        r = exc.response
        print(f"export_log: {r.request.method} {r.request.url.path}: HTTP {r.status_code} "
              f"{r.text}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
