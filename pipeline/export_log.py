"""Export Detour's latency log (``GET /latency-log``) to a Parquet file for the analysis job.

Why: the log is every report producers made (broker, latency, isolation,
producer, time), but it lives in a bounded Redis stream (``DETOUR_LATENCY_LOG_MAX``,
default 100,000 entries, trimmed oldest first). Exporting it keeps a run's
evidence after the stream moves on, and Parquet is what Spark reads fastest.

Pages are read oldest first with ``after=<last id>`` and written one row group
per page through a ``ParquetWriter``, so memory stays at one page whatever the
log's size. The export stops at the first short or empty page (the log's end as
of then); ``--after`` resumes an earlier export. Plain Python with pyarrow: no
Spark needed for a single sequential reader.

    python -m pipeline.export_log --detour http://127.0.0.1:8080 --out /tmp/latency.parquet

``GET /latency-log`` is an admin call: a Detour with tokens needs an admin token
in ``DETOUR_TOKEN`` (or ``--token``); without one the export stops at the first
page with the 401 (403 for a producer token).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

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


def to_table(entries: Sequence[dict[str, Any]]) -> pa.Table:
    """Log entries (the endpoint's JSON) as a table with ``SCHEMA``."""
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
) -> Export:
    """Page through the log after ``after`` (None: from the start) into ``out``.

    ``token``: an admin token, sent as ``Authorization: Bearer`` (None: no header).
    """
    if not 1 <= page <= MAX_PAGE:
        raise ValueError(f"page must be 1..{MAX_PAGE}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = pages = 0
    first: str | None = None
    cursor = after
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
            writer.write_table(to_table(entries))
            rows += len(entries)
            pages += 1
            first = first or str(entries[0]["id"])
            cursor = body["next"] or str(entries[-1]["id"])
            if len(entries) < page:
                break
        if rows == 0:
            writer.write_table(SCHEMA.empty_table())
    return Export(rows, pages, first, cursor if rows else after, str(out))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.export_log", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--detour", default="http://127.0.0.1:8080")
    p.add_argument("--out", required=True, help="the Parquet file to write")
    p.add_argument("--after", default=None, help="resume after this log id")
    p.add_argument("--page", type=int, default=MAX_PAGE, help=f"entries per call (<= {MAX_PAGE})")
    add_token_argument(p, "admin")
    args = p.parse_args(argv)
    try:
        result = export(args.detour, args.out, args.after, args.page,
                        token=detour_token(args.token))
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
