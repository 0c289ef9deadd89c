"""The pipeline's pure parts: tier replay, the recommendation rule, specs, log paging.

No Spark and no process here: the replay and the rule are the analysis job's
arithmetic, checked against hand-computed scenarios so the Spark test only has
to show the job wires them up.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.analyze import (
    DEFAULT_LATENCY_MAX,
    ROCKETMQ,
    Analysis,
    TierTable,
    auto_window_s,
    avoided_bars,
    avoided_spans,
    fault_marks,
    latency_figure,
    latency_series,
    markdown,
    moved_elsewhere,
    read_faults,
    recommend,
    replay,
    window_of,
)
from pipeline.brokers import Fault, broker_names
from pipeline.export_log import SCHEMA, export
from pipeline.generate import record_id
from tests.procs import ROOT

pytestmark = pytest.mark.unit

T0 = 1_800_000_000_000  # a multiple of 60 s
MIN = 60_000


def scenario_b() -> list[tuple[int, int, bool]]:
    """broker-b: 100 sends of 10 ms, a failure at +120 s, then 50 sends of 5 ms from +150 s."""
    reports = [(T0 + MIN + i * 100, 10, False) for i in range(100)]
    reports.append((T0 + 2 * MIN, 200, True))
    reports += [(T0 + 150_000 + i * 1000, 5, False) for i in range(50)]
    return reports


def test_a_failure_avoids_the_broker_until_the_log_ends() -> None:
    w = replay(scenario_b(), ROCKETMQ, MIN, T0, T0 + 5 * MIN)
    # 600 s from +120 s, clipped at +300 s: windows 2, 3 and 4 entirely.
    assert {ws: r.avoided_ms for ws, r in w.items() if r.avoided_ms} == {
        T0 + 2 * MIN: MIN, T0 + 3 * MIN: MIN, T0 + 4 * MIN: MIN,
    }
    # The 50 sends after the failure were selected while it was avoided (a stale producer).
    assert w[T0 + 2 * MIN].avoided_selects == 30 and w[T0 + 3 * MIN].avoided_selects == 20
    assert sum(r.avoided_failures for r in w.values()) == 0
    assert sum(r.selects for r in w.values()) == 151


def test_alternative_table_counts_hand_computed_avoided_selects() -> None:
    strict = TierTable.parse("strict=5,10:0,60000")
    w = replay(scenario_b(), strict, MIN, T0, T0 + 5 * MIN)
    # 10 ms opens 60 s: the 99 sends after the first are avoided; the failure's select
    # (at +119.8 s, before the window from +69.9 s ends) is spared; the failure opens
    # 60 s more (+180 s): sends selected before then (i = 0..30) are avoided.
    assert sum(r.avoided_selects for r in w.values()) == 99 + 1 + 31
    assert sum(r.avoided_failures for r in w.values()) == 1
    assert sum(r.avoided_ok for r in w.values()) == 130
    # Avoided from +60 s to +180 s, minus nothing: one merged window.
    assert sum(r.avoided_ms for r in w.values()) == 2 * MIN


def test_last_report_wins_lets_a_fast_success_end_the_window() -> None:
    reports = [(T0, 0, True), (T0 + 1000, 1, False), (T0 + 5000, 1, False)]
    extend = replay(reports, ROCKETMQ, MIN, T0, T0 + MIN)
    overwrite = replay(reports, TierTable("4x", last_report_wins=True), MIN, T0, T0 + MIN)
    assert extend[T0].avoided_ms == MIN and extend[T0].avoided_selects == 2
    assert overwrite[T0].avoided_ms == 1000 and overwrite[T0].avoided_selects == 1


def test_a_slow_send_opens_its_tier_and_selection_time_is_at_minus_latency() -> None:
    # 600 ms falls in the 550 ms tier (30 s). A send that started before the window
    # opened (it took 2 s) is not an avoided select, though it completed inside it.
    reports = [(T0 + 1000, 600, False), (T0 + 3000, 2500, False), (T0 + 4000, 1, False)]
    w = replay(reports, ROCKETMQ, MIN, T0, T0 + MIN)
    assert w[T0].avoided_selects == 1
    # 2500 ms is the 2000 ms tier: 120 s from +3 s, which outlasts the 30 s one.
    assert w[T0].avoided_ms == MIN - 1000


def test_windows_split_avoided_time_at_their_boundaries() -> None:
    w = replay([(T0 + 50_000, 0, True)], ROCKETMQ, MIN, T0, T0 + 3 * MIN)
    assert [w[T0 + i * MIN].avoided_ms for i in range(3)] == [10_000, MIN, MIN]
    assert window_of(T0 + 59_999, MIN) == T0


def test_recommendation_follows_the_documented_rule() -> None:
    t = recommend(0, 2)  # loopback brokers: median 0 ms, q99 2 ms -> s = 0.02
    assert t.latency_max == (0, 2, 11, 20, 40, 60, 300, 30000)
    assert t.durations == (0, 0, 1000, 1200, 2400, 3600, 12000, 600000)
    t.config()  # a config Detour accepts
    t = recommend(20, 80, factor=2)  # s = 1.6
    assert t.latency_max == (20, 160, 880, 1600, 3200, 4800, 24000, 30000)
    assert t.durations == (0, 0, 30000, 60000, 120000, 180000, 600000, 600000)
    assert t.name == "x2"
    # A fleet so slow its top tier passes isolationLatencyMs: failures share that tier.
    t = recommend(1000, 30000)
    assert len(t.latency_max) == len(DEFAULT_LATENCY_MAX)
    assert t.isolation_latency_ms == t.latency_max[-1] and t.durations[-1] == 600000
    t.config()


def test_tier_table_parse() -> None:
    t = TierTable.parse("fast=50,100,200:0,0,5000")
    assert t.body()["latencyMax"] == [50, 100, 200]
    for bad in ("nameonly", "x=1,2:0", "x=2,1:0,0", "=1:0"):
        with pytest.raises(ValueError):
            TierTable.parse(bad)
    assert TierTable.from_body("c", {"lastReportWins": True}).last_report_wins


def test_fault_specs() -> None:
    f = Fault.parse("kill:broker-b@5000r+4")
    assert (f.action, f.broker, f.records, f.at_s, f.hold_s) == ("kill", "broker-b", 5000,
                                                                  None, 4.0)
    assert Fault.parse("stop:broker-c@2.5s").spec() == "stop:broker-c@2.5s"
    for bad in ("boom:broker-a@1s", "pause:broker-a@1s", "kill:broker-a", "kill@1s"):
        with pytest.raises(ValueError):
            Fault.parse(bad)
    assert broker_names(3) == ["broker-a", "broker-b", "broker-c"]
    names = broker_names(30)
    assert names[0] == "broker-000" and names == sorted(names) and len(set(names)) == 30
    assert record_id(42) == "rec-000000000042"


def test_export_pages_until_a_short_page(tmp_path: Path) -> None:
    log = [{"id": f"{1000 + i}-0", "brokerName": "broker-a", "latencyMs": i % 7,
            "isolation": i % 100 == 0, "producer": f"p{i % 3}", "at": 1000 + i}
           for i in range(2500)]
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        after = request.url.params.get("after")
        limit = int(request.url.params["limit"])
        seen.append(after)
        start = 0 if after is None else next(i for i, e in enumerate(log)
                                             if e["id"] == after) + 1
        page = log[start:start + limit]
        return httpx.Response(200, json={"entries": page,
                                         "next": page[-1]["id"] if page else None})

    out = tmp_path / "log.parquet"
    result = export("http://detour", out, page=1000, transport=httpx.MockTransport(handler))
    assert (result.rows, result.pages, result.last_id) == (2500, 3, "3499-0")
    assert seen == [None, "1999-0", "2999-0"]
    table = pq.read_table(out)
    assert table.schema.equals(SCHEMA) and table.num_rows == 2500
    assert table.column("isolation").to_pylist().count(True) == 25
    assert json.dumps(table.slice(0, 1).to_pylist()[0]["producer"]) == '"p0"'


def test_executor_pod_template_runs_detour_as_a_native_sidecar() -> None:
    pod = yaml.safe_load((ROOT / "deploy/spark/executor-pod-template.yaml").read_text())
    assert pod["kind"] == "Pod"
    (sidecar,) = pod["spec"]["initContainers"]
    assert sidecar["restartPolicy"] == "Always"  # native sidecar: starts first, exits last
    assert "--host=127.0.0.1" in sidecar["args"] and "--port=8080" in sidecar["args"]
    assert {e["name"] for e in sidecar["env"]} >= {"DETOUR_REDIS_URL", "DETOUR_REDIS_PASSWORD_FILE"}
    probe = " ".join(sidecar["startupProbe"]["exec"]["command"])
    assert "/dev/tcp/127.0.0.1/8080" in probe and "GET /readyz" in probe
    assert [c["name"] for c in pod["spec"]["containers"]] == ["spark-executor"]


def test_the_window_follows_the_logs_span() -> None:
    # At most 30 windows of a round length: a 6.5 s run in half seconds, an hour in 2 min.
    assert auto_window_s(6_500) == 0.5
    assert auto_window_s(300_000) == 10
    assert auto_window_s(3_600_000) == 120
    assert auto_window_s(0) == 0.1
    assert auto_window_s(10 * 86_400_000) == 43_200
    assert auto_window_s(100 * 86_400_000) == 86_400  # the longest there is


def test_avoided_bars_sit_inside_their_window_and_the_logs_span() -> None:
    """A 6 s log in 2 s windows that start 1 s before it (windows are aligned to the clock):
    every bar lies within its window, clipped to the log, brokers side by side."""
    start = T0 + 1_000
    windows = [{"broker": b, "window_start": T0 + k * 2_000, "avoided_ms": ms}
               for b, per_window in (("broker-a", (0, 2_000, 1_000, 0)),
                                     ("broker-b", (500, 0, 0, 1_000)))
               for k, ms in enumerate(per_window)]
    a = Analysis(reports=10, start_ms=start, end_ms=start + 6_000, window_ms=2_000,
                 current="rocketmq", pooled={}, successes=10, windows=windows, brokers=[],
                 tables=[], recommendation={})
    bars = avoided_bars(a)
    assert set(bars) == {"broker-a", "broker-b"}
    # Window 0 covers [-1, 1) s of the log: clipped to [0, 1); window 3 to [5, 6).
    assert bars["broker-a"] == [(0.0, 0.45, 0.0), (1.0, 0.9, 100.0), (3.0, 0.9, 50.0),
                                (5.0, 0.45, 0.0)]
    assert bars["broker-b"] == [(0.5, 0.45, 50.0), (2.0, 0.9, 0.0), (4.0, 0.9, 0.0),
                                (5.5, 0.45, 100.0)]
    for x, width, _ in bars["broker-a"] + bars["broker-b"]:
        assert 0 <= x and x + width <= 6.0


def test_avoided_spans_are_the_replays_avoided_time() -> None:
    for table in (ROCKETMQ, TierTable.parse("strict=5,10:0,60000")):
        spans = avoided_spans(scenario_b(), table, T0, T0 + 5 * MIN)
        total = sum(r.avoided_ms for r in replay(scenario_b(), table, MIN, T0,
                                                 T0 + 5 * MIN).values())
        assert sum(b - a for a, b in spans) == total
        assert all(a < b for a, b in spans) and spans == sorted(spans)
        assert all(s[1] < n[0] for s, n in zip(spans, spans[1:], strict=False)), "merged"
    # RocketMQ tiers: one span, from the failure to the log's end.
    assert avoided_spans(scenario_b(), ROCKETMQ, T0, T0 + 5 * MIN) == [
        (T0 + 2 * MIN, T0 + 5 * MIN)]


def live_run() -> tuple[list[tuple[str, int, int, bool]], int]:
    """A 10 s run with Detour live: 4 brokers at one send per 10 ms each; broker-b fails
    at +3 s and is never sent to again (avoided), the others go on. Returns the reports
    (broker, at, latency, isolation) and the sends of the others selected after +3 s."""
    reports = []
    for broker in ("broker-a", "broker-c", "broker-d"):
        reports += [(broker, T0 + i * 10, 0, False) for i in range(1000)]
    reports += [("broker-b", T0 + i * 10, 0, False) for i in range(300)]
    reports.append(("broker-b", T0 + 3000, 0, True))
    after = sum(1 for b, at, _, _ in reports if b != "broker-b" and at >= T0 + 3000)
    return reports, after


def test_the_selects_detour_moved_elsewhere_are_estimated_from_the_others_sends() -> None:
    """The log of a live run has no send to broker-b after its failure, so replaying its
    sends finds none inside its window (0 avoided, 0 spared): Detour did its job, and the
    log alone says nothing of the selects it moved. The estimate does: a quarter of the
    others' sends selected while broker-b was avoided (round-robin over 4 brokers)."""
    reports, after = live_run()
    end = max(r[1] for r in reports) + 1
    by_broker: dict[str, list[tuple[int, int, bool]]] = {}
    for b, at, latency, isolation in reports:
        by_broker.setdefault(b, []).append((at, latency, isolation))
    in_window = sum(w.avoided_selects for rs in by_broker.values()
                    for w in replay(rs, ROCKETMQ, MIN, T0, end).values())
    assert in_window == 0
    spans = {b: s for b, rs in by_broker.items() if (s := avoided_spans(rs, ROCKETMQ, T0, end))}
    assert spans == {"broker-b": [(T0 + 3000, end)]}
    sends = [(b, at - latency) for b, at, latency, _ in reports]
    assert after == 2100
    assert moved_elsewhere(sends, spans, 4) == after / 4 == 525
    # Its own sends are never counted (they went to it); two avoided brokers, twice the
    # chance that round-robin starts on one.
    assert moved_elsewhere([("broker-b", T0 + 5000)], spans, 4) == 0
    both = {**spans, "broker-c": [(T0, end)]}
    assert moved_elsewhere([("broker-a", T0 + 5000)], both, 4) == 0.5
    assert moved_elsewhere(sends, spans, 0) == 0


def _analysis_of_a_kill() -> Analysis:
    """2 brokers in 1 s windows over 6 s: broker-a fine; broker-b's first send is cold
    (2,264 ms), it is killed at +3 s and fails twice in the next window, then is avoided."""
    start = T0
    windows = []
    for k in range(6):
        windows.append({"broker": "broker-a", "window_start": T0 + k * 1000, "reports": 10,
                        "isolations": 0, "p50": 1.0, "p90": 2.0, "p99": 3.0, "max": 4.0,
                        "avoided_ms": 0})
    for k in range(3):
        windows.append({"broker": "broker-b", "window_start": T0 + k * 1000, "reports": 10,
                        "isolations": 0, "p50": 1.0, "p90": 2.0, "p99": 2.0,
                        "max": 2264.0 if k == 0 else 3.0, "avoided_ms": 0})
    windows.append({"broker": "broker-b", "window_start": T0 + 3000, "reports": 2,
                    "isolations": 2, "p50": None, "p90": None, "p99": None, "max": None,
                    "avoided_ms": 900})
    faults = [{"at_ms": T0 + 3000, "action": "kill", "broker": "broker-b"},
              {"at_ms": T0 + 60_000, "action": "restart", "broker": "broker-b"}]
    return Analysis(reports=60, start_ms=start, end_ms=start + 6000, window_ms=1000,
                    current="rocketmq", pooled={}, successes=58, windows=windows, brokers=[],
                    tables=[], recommendation={}, faults=faults)


def test_the_latency_plot_shows_failures_faults_and_every_mark_whole() -> None:
    """A failed broker's line stops where its sends fail: the failures are drawn instead
    (crosses with their count, above every latency); the kill is a dotted line; the cold
    send's max has room above it, so no mark sits on the plot's edge."""
    import matplotlib.pyplot as plt

    a = _analysis_of_a_kill()
    series = latency_series(a)
    assert series["broker-b"].failures == [(3.5, 2)]
    assert [p[0] for p in series["broker-b"].points] == [0.5, 1.5, 2.5]
    assert fault_marks(a) == [(3.0, "kill broker-b")]  # the restart is after the log
    fig = latency_figure(a)
    try:
        ax = fig.axes[0]
        bottom, top = ax.get_ylim()
        marks = {c.get_gid(): c.get_offsets().tolist() for c in ax.collections
                 if c.get_gid()}
        assert marks["failures:broker-b"][0][0] == 3.5
        band = marks["failures:broker-b"][0][1]
        ys = [y for line in ax.lines for y in line.get_ydata()
              if line.get_gid() is None and len(line.get_ydata()) > 1]
        ys += [y for gid, offs in marks.items() if gid.startswith("max:") for _, y in offs]
        assert 2264.0 in ys and max(ys) == 2264.0
        # Every latency below the failure band, the band and its counts below the top
        # (symlog: a factor of 3 leaves a marker's height and a label).
        assert band > max(ys) and top >= 3 * band and bottom == 0
        xs = [x for offs in marks.values() for x, _ in offs]
        assert all(0 <= x <= 6 for x in xs)
        faults = [line.get_xdata()[0] for line in ax.lines if line.get_gid() == "fault"]
        assert faults == [3.0]
        assert [t.get_text().strip() for t in ax.texts if t.get_gid() == "fault-label"] == [
            "kill broker-b"]
        assert [t.get_text() for t in ax.texts if t.get_text() == "2"], "the count of failures"
    finally:
        plt.close(fig)


def test_faults_come_from_the_brokers_events_or_its_printed_output(tmp_path: Path) -> None:
    path = tmp_path / "faults.jsonl"
    path.write_text("\n".join([
        json.dumps({"topic": "orders", "brokers": []}),  # the fleet, as printed first
        json.dumps({"fault": {"at_ms": 20, "elapsed_s": 2.0, "action": "cont",
                              "broker": "broker-c", "messages": None, "error": None}}),
        json.dumps({"fault": {"at_ms": 10, "elapsed_s": 1.0, "action": "kill",
                              "broker": "broker-b", "messages": 3000, "error": None}}),
        json.dumps({"fault": {"at_ms": 30, "elapsed_s": 3.0, "action": "stop",
                              "broker": "broker-d", "error": "ProcessLookupError()"}}),
        "not json",
    ]))
    assert read_faults(path) == [{"at_ms": 10, "action": "kill", "broker": "broker-b"},
                                 {"at_ms": 20, "action": "cont", "broker": "broker-c"}]


def test_the_replay_table_says_what_detour_moved_and_what_got_through() -> None:
    a = _analysis_of_a_kill()
    row = {"name": "rocketmq", "latencyMax": [1], "notAvailableDuration": [0], "selects": 3000,
           "avoided_selects": 0, "avoided_failures": 0, "avoided_ok": 0, "avoided_ms": 7000,
           "moved_selects": 729.0}
    a.tables = [row]
    a.recommendation = {"name": "recommended", "factor": "x1"}
    a.pooled = {"p50": 1.0, "p90": 2.0, "p99": 3.0, "p999": 4.0}
    text = markdown(a)
    assert "| moved elsewhere (est.) | sent into a window | of them failed |" in text
    assert "| 3000 | 729 | 0 | 0 | 0 | 7.0 |" in text
    assert "near 0 is Detour working" in text


@pytest.mark.integration
def test_the_reports_command_patches_the_named_detour_and_changes_nothing_else(
        tmp_path: Path) -> None:
    """The command in report.md goes to the Detour ``--detour`` named (not a hard-coded
    address) and is a merge patch: run word for word against a live Detour whose config
    has other settings, it installs the tiers and leaves the rest as they were."""
    import shlex
    import subprocess

    from tests.procs import ServiceProcess

    with ServiceProcess() as svc:
        httpx.patch(svc.url + "/config", json={"latencyQuorum": 2, "rampMs": 3000},
                    timeout=10).raise_for_status()
        a = _analysis_of_a_kill()
        a.detour = svc.url
        a.recommendation = {"name": "recommended", "factor": "x1", "sendLatencyFaultEnable": True,
                            "latencyMax": [7, 100, 200], "notAvailableDuration": [0, 0, 5000],
                            "isolationLatencyMs": 30000, "lastReportWins": False}
        a.pooled = {"p50": 1.0, "p90": 2.0, "p99": 3.0, "p999": 4.0}
        text = markdown(a)
        command = text.split("```sh\n", 1)[1].split("\n```", 1)[0]
        assert command.startswith(f"curl -X PATCH {svc.url}/config")
        argv = shlex.split(command.replace("${DETOUR_TOKEN:+-H \"Authorization: Bearer "
                                           "$DETOUR_TOKEN\"}", "").replace("\\\n", " "))
        done = subprocess.run([*argv, "-s", "-o", str(tmp_path / "out"), "-w", "%{http_code}"],
                              capture_output=True, text=True, timeout=30)
        assert done.stdout == "200", (done.stdout, done.stderr)
        config = httpx.get(svc.url + "/config", timeout=10).json()
        assert config["latencyMax"] == [7, 100, 200]
        assert (config["latencyQuorum"], config["rampMs"]) == (2, 3000)  # kept
