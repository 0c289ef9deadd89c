"""The fleet benchmark at a tiny scale: it drives a real redis-server with real connections,
every push reaches every subscription, and its figures and projection are sane."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import fleet


@pytest.mark.integration
@pytest.mark.slow
def test_quick_run_measures_and_projects(tmp_path: Path) -> None:
    plot = tmp_path / "fleet.png"
    assert fleet.main(["--quick", "--out", str(tmp_path), "--plot", str(plot)]) == 0
    result = json.loads((tmp_path / "fleet.json").read_text())
    opts = result["options"]
    assert opts["replicas"] == [10, 50]
    for n, v in result["replicas"].items():
        ph = v["phases"]
        # every replica polled about once per sync interval, the phase long enough for it
        expected = int(n) * ph["poll"]["seconds"] / opts["sync_interval_s"]
        # (the last due poll may fall after the phase's end)
        assert ph["poll"]["units"] >= 0.8 * expected - 1, (n, ph["poll"])
        # each poll is a script call plus what it runs: at least one command per poll
        assert ph["poll"]["commands_per_s"] * ph["poll"]["seconds"] >= ph["poll"]["units"]
        assert (
            ph["flush"]["units"]
            >= 0.8 * int(n) * ph["flush"]["seconds"] / opts["flush_interval_s"] - 1
        )
        # every flush reached report.lua and logged each of its brokers
        assert ph["flush"]["log_entries"] >= ph["flush"]["units"] * opts["flush_brokers"]
        for name in ("push", "mixed"):
            assert ph[name]["units"] >= 1, (n, name)
            # every window pushed reached every simulated replica's subscription
            assert ph[name]["delivered"] == 1.0, (n, name, ph[name])
            assert 0 < ph[name]["propagation_p99_ms"] < 10_000
            assert 0 <= ph[name]["fanout_p99_ms"] <= ph[name]["propagation_p99_ms"]
        assert ph["fast"]["units"] > 0
        for name in fleet.PHASES:
            assert ph[name]["redis_cpu_s"] >= 0
            assert 0 <= ph[name]["machine_idle"] <= 1
    m = result["model"]
    assert m["fast_report_us"] > 0
    assert all(math.isfinite(x) and x >= 0 for x in m.values())
    rows = result["projection"]
    assert [r["sidecars"] for r in rows] == list(fleet.SIDECARS)
    for r in rows:
        cores = list(r["cores"].values())
        assert cores == sorted(cores), r  # more faults never cost less
        # writing every send is what the flushes replace: it costs more at every size
        assert r["per_send_cores"] > r["cores"]["0"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| sidecars |" in (tmp_path / "fleet.md").read_text()


@pytest.mark.unit
def test_model_grows_with_sidecars_and_faults() -> None:
    m = fleet.Model(
        conn_us_s=0.5,
        poll_us=10,
        flush_us=20,
        report_us=50,
        per_sub_us=1,
        fast_report_us=30,
        sync_interval_s=1,
        flush_interval_s=1,
    )
    # 1,000 sidecars: 1,000 connections x2 x0.5 + 1,000 polls x10 + 1,000 flushes x20 µs/s
    assert m.cores(1_000, 0) == pytest.approx((1_000 + 10_000 + 20_000) / 1e6)
    # each window: the script + one delivery per subscription
    assert m.cores(1_000, 10) - m.cores(1_000, 0) == pytest.approx(10 * (50 + 1_000) / 1e6)
    assert m.max_faults(1_000) == pytest.approx((0.8 - m.cores(1_000, 0)) * 1e6 / 1_050)
    assert m.max_faults(10_000) < m.max_faults(1_000)
    assert m.max_faults(1e9) == 0


@pytest.mark.unit
def test_line_fits_exactly() -> None:
    assert fleet.line([1, 2, 3], [5, 7, 9]) == pytest.approx((3, 2))
    assert fleet.resp("GET", "k") == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"


@pytest.mark.integration
@pytest.mark.slow
def test_quick_tier_run_spreads_the_fanout_over_replicas(tmp_path: Path) -> None:
    """``--redis-replicas 0,1,2 --quick``: real replicas, every push reaches every
    subscription through them, the replicas bear the deliveries, and the projection names a
    replica count for each fleet."""
    from bench import fleet_tier

    plot = tmp_path / "tier.png"
    assert fleet.main(["--redis-replicas", "0,1,2", "--quick", "--out", str(tmp_path),
                       "--plot", str(plot)]) == 0
    result = json.loads((tmp_path / "fleet-tier.json").read_text())
    by = result["by_redis_replicas"]
    assert list(by) == ["0", "1", "2"]
    for r, row in by.items():
        assert row["push"]["delivered"] == 1.0 and row["mixed"]["delivered"] == 1.0, r
        assert row["costs"]["primary_push_us"] > 0 and row["costs"]["primary_flush_us"] > 0
        if r != "0":
            # the deliveries run on the replicas, and they answer the polls
            assert row["costs"]["replica_per_sub_us"] > 0 and row["costs"]["replica_poll_us"] > 0
    assert "replica_per_sub_us" not in by["0"]["costs"]
    rows = result["projection"]
    assert {r["sidecars"] for r in rows} == set(fleet_tier.SIDECARS)
    for r in rows:
        assert r["primary_cores"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| Redis replicas |" in (tmp_path / "fleet-tier.md").read_text()
