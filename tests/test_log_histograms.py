"""The latency log's histogram form: the analysis recommends the same tiers from it as from
every report, and the export turns a histogram back into its reports (docs/semantics.md)."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest

from detour import strategy
from detour.model import LATENCY_BUCKETS, Config
from pipeline.analyze import log_resolution, percentile, recommend_in_process
from pipeline.export_log import bucket_value, expand, to_table
from service.store.aggregate import Aggregate, bucket_of

pytestmark = pytest.mark.unit

TIER_EDGES = (50, 100, 550, 1000, 2000, 3000, 15000)


def _full_log(
    seed: int, brokers: int = 3, minutes: int = 10, per_s: int = 8
) -> list[tuple[str, int, int, bool]]:
    """Every report: lognormal sends around 20 ms, a slow spell on one broker (windows),
    a few failures."""
    rnd = random.Random(seed)
    out = []
    for b in range(brokers):
        name = f"broker-{b}"
        for k in range(minutes * 60 * per_s):
            at = 1_700_000_000_000 + k * 1000 // per_s + rnd.randrange(1000 // per_s)
            latency = int(rnd.lognormvariate(3.0 + 0.3 * b, 0.6))
            if b == 0 and 180_000 <= k * 1000 // per_s < 240_000:
                latency = rnd.randint(300, 1500)  # a slow minute: windows open
            isolation = rnd.random() < 0.0005
            out.append((name, at, latency, isolation))
    return sorted(out, key=lambda r: r[1])


def _histogram_log(full: list[tuple[str, int, int, bool]]) -> list[dict[str, Any]]:
    """The same reports as a replica logs them: a report with a window or a failure one by
    one, the rest summed per broker per 1 s flush (service/store/aggregate.py)."""
    config = Config()
    entries: list[dict[str, Any]] = []
    pending: dict[int, Aggregate] = defaultdict(lambda: Aggregate(100))
    for broker, at, latency, isolation in full:
        duration = strategy.report_duration(config, latency, isolation)
        if isolation or duration > 0:
            entries.append(
                {
                    "id": f"{at}-{len(entries)}",
                    "brokerName": broker,
                    "latencyMs": latency,
                    "isolation": isolation,
                    "producer": "p",
                    "at": at,
                }
            )
        else:
            assert pending[at // 1000].add(broker, "p", latency, at)
    for interval, agg in sorted(pending.items()):
        for s in agg.take():
            entries.append(
                {
                    "id": f"{interval}-h-{s.broker}",
                    "brokerName": s.broker,
                    "latencyMs": -1,
                    "isolation": False,
                    "producer": "p",
                    "at": s.at_ms,
                    "since": s.since_ms,
                    "histogram": s.counts,
                }
            )
    return entries


def test_the_buckets_hold_the_tier_edges_and_a_value_stays_in_its_bucket() -> None:
    assert set(TIER_EDGES) <= set(LATENCY_BUCKETS)
    assert list(LATENCY_BUCKETS) == sorted(set(LATENCY_BUCKETS))
    for i in range(len(LATENCY_BUCKETS)):
        assert bucket_of(bucket_value(i)) == i
    config = Config()
    for latency in range(0, 20_000, 7):
        # a report and its histogram row fall in the same tier
        i = bucket_of(latency)
        assert strategy.tier(config, latency) == strategy.tier(config, bucket_value(i))


def test_expand_gives_back_every_report_of_a_histogram_inside_its_interval() -> None:
    counts = [0] * len(LATENCY_BUCKETS)
    counts[bucket_of(20)], counts[bucket_of(70)] = 5, 3
    entry = {
        "id": "1-0",
        "brokerName": "a",
        "latencyMs": -1,
        "isolation": False,
        "producer": "p",
        "at": 2000,
        "since": 1000,
        "histogram": counts,
    }
    rows = expand(entry)
    assert len(rows) == 8
    assert sorted(r["latencyMs"] for r in rows) == [22] * 5 + [74] * 3
    assert all(1000 <= r["at"] <= 2000 for r in rows)
    assert (
        to_table([entry, {**entry, "id": "1-1", "histogram": None, "latencyMs": 9}]).num_rows == 9
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_recommendation_from_histograms_is_the_one_from_every_report(seed: int) -> None:
    full = _full_log(seed)
    entries = _histogram_log(full)
    # the log is much shorter: one entry per broker per second, plus the significant ones
    assert len(entries) < len(full) / 2
    rows = [row for e in entries for row in expand(e)]
    assert len(rows) == len(full)
    histo = [
        (r["brokerName"], int(r["at"]), int(r["latencyMs"]), bool(r["isolation"])) for r in rows
    ]
    from_full = recommend_in_process(full)
    from_histograms = recommend_in_process(histo)
    assert from_histograms.body() == from_full.body()
    assert from_histograms.name == from_full.name
    # read at the log's resolution, the percentiles are the same from both forms
    ok_full = sorted(r[2] for r in full if not r[3])
    ok_h = sorted(r[2] for r in histo if not r[3])
    assert log_resolution(percentile(ok_full, 0.99)) == log_resolution(percentile(ok_h, 0.99))
