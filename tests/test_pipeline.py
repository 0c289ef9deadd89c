"""The Spark pipeline for real: Spark ``local[2]``, redis-server brokers, Detour on Redis.

One SparkSession for this file and tests/test_pipeline_cli.py (conftest.py's ``spark``).
The end-to-end test is the product claim: 20,000 records through 4 broker
processes while one is SIGKILLed and another SIGSTOPped for 5 s; afterwards
every record is on a broker, the failed attempts are a small fraction of what
round-robin would have paid, and Detour's table shows the killed broker
avoided. Every wait is bounded; everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from detour.client.wire import MAX_BATCH
from pipeline import brokers as brokers_cli
from pipeline.analyze import (
    TierTable,
    analyze,
    auto_window_s,
    avoided_spans,
    fault_marks,
    log_resolution,
    moved_elsewhere,
    read_faults,
    recommend,
    replay,
)
from pipeline.brokers import Fleet, no_retry, stream_key
from pipeline.export_log import Export, RunScope, export, to_table
from pipeline.generate import generate, record_id
from pipeline.produce import ProduceOptions, produce, read_input
from pipeline.progress import Progress
from pipeline.verify import BrokerRef, brokers_from_detour, read_ids, verify
from tests.procs import PATIENT_ENV, RedisServer, ServiceProcess
from tests.proxy import DelayProxy

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

RECORDS = 20_000
SPARK = [pytest.mark.spark, pytest.mark.slow]


def _export_once(detour: str, path: Path, done: Callable[[Export], bool],
                 **kw: Any) -> Export:
    """The export once ``done`` holds: a replica writes the reports that changed no window
    with its next flush (docs/semantics.md, 1 s), so the log is complete a moment after
    the last send. Bounded: the last export is returned after 15 s."""
    deadline = time.monotonic() + 15
    while True:
        result = export(detour, path, **kw)
        if done(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.2)


def _journal_replayed(detour: str) -> float:
    """Reports Detour journaled and handed to Redis later (``detour_journal_replayed_total``)."""
    text = httpx.get(f"{detour}/metrics", timeout=5).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "detour_journal_replayed" for sample in family.samples
               if sample.name == "detour_journal_replayed_total")


# -- brokers: the faults are real ---------------------------------------------------------


@pytest.mark.integration
def test_broker_faults_are_process_faults() -> None:
    with Fleet(2, "t", 1) as fleet:
        b = fleet.brokers["broker-a"]
        # A timeout far above any delay a loaded machine adds, for the writes that must
        # succeed; the 0.2 s client below is for the stopped broker, whose timeout is the point.
        patient = redis.Redis(host="127.0.0.1", port=b.port, socket_timeout=5,
                              socket_connect_timeout=5, retry=no_retry())
        client = redis.Redis(host="127.0.0.1", port=b.port, socket_timeout=0.2,
                             socket_connect_timeout=0.2, retry=no_retry())
        patient.xadd(stream_key("t", 0), {"id": "r1"})
        b.kill()
        with pytest.raises(redis.ConnectionError):
            client.xadd(stream_key("t", 0), {"id": "r2"})
        b.restart()  # same port; the AOF brings r1 back
        assert b.messages("t") == 1
        b.stop()
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            client.xadd(stream_key("t", 0), {"id": "r3"})
        assert 0.15 < time.monotonic() - started < 2.0
        b.cont()
        client.close()
        # Added latency: writes wait, then succeed (the patient client: a loaded machine
        # cannot turn the delay into a failure).
        b.pause(0.15)
        started = time.monotonic()
        patient.xadd(stream_key("t", 0), {"id": "r4"})
        assert time.monotonic() - started >= 0.1
        patient.close()


@pytest.mark.integration
def test_the_brokers_cli_writes_the_faults_it_fires_for_the_analysis(tmp_path: Path) -> None:
    """`pipeline.brokers start --events FILE`: each fault as it fires, one JSON line, what
    `pipeline.analyze --faults` marks on its plots (the same lines are printed)."""
    events = tmp_path / "faults.jsonl"
    printed: list[str] = []
    started_ms = time.time_ns() // 1_000_000
    # The kill fires at once and its restart 0.2 s later; --for ends the run after both.
    assert brokers_cli.main(["start", "--n", "2", "--queues", "1", "--topic", "ev",
                             "--no-persist", "--fault", "kill:broker-b@0s+0.2",
                             "--events", str(events), "--for", "2"], out=printed.append) == 0
    faults = read_faults(events)
    assert [(f["action"], f["broker"]) for f in faults] == [("kill", "broker-b"),
                                                            ("restart", "broker-b")]
    assert started_ms <= faults[0]["at_ms"] <= faults[1]["at_ms"] <= time.time_ns() // 1_000_000
    assert [json.loads(line) for line in events.read_text().splitlines()] == [
        json.loads(line) for line in printed if line.startswith('{"fault"')]


# -- generate / read ----------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["parquet", "json", "csv"])
def test_generated_input_round_trips(spark: SparkSession, tmp_path: Path, fmt: str) -> None:
    out = str(tmp_path / "in")
    generate(spark, 1000, out, fmt, partitions=3, payload_bytes=100)  # type: ignore[arg-type]
    df = read_input(spark, out)
    rows = df.collect()
    assert len(rows) == 1000 and len({r["id"] for r in rows}) == 1000
    assert {len(r["payload"]) for r in rows} == {100}
    assert min(r["id"] for r in rows) == record_id(0)
    # verify reads the ids alone (no schema inference, no payloads): the same ids.
    ids = read_ids(spark, out)
    assert ids.columns == ["id"]
    assert {r["id"] for r in ids.collect()} == {r["id"] for r in rows}


# -- verify ---------------------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
def test_verify_finds_missing_and_duplicates(spark: SparkSession) -> None:
    expected = spark.createDataFrame([(record_id(i),) for i in range(100)], "id string")
    with Fleet(2, "v", 2) as fleet:
        a, b = fleet.brokers["broker-a"].client(), fleet.brokers["broker-b"].client()
        for i in range(100):
            if i in (7, 8, 9):
                continue  # lost
            (a if i % 2 else b).xadd(stream_key("v", i % 2), {"id": record_id(i)})
        for i in (1, 2):
            a.xadd(stream_key("v", 0), {"id": record_id(i)})  # at-least-once copies
        a.xadd(stream_key("v", 1), {"id": "stranger"})
        refs = [BrokerRef(n, x.address, 2) for n, x in fleet.brokers.items()]
        progress = Progress("verify", "entries read", spark.sparkContext, out=io.StringIO(),
                            every_s=0.2)
        v = verify(spark, expected, refs, "v", progress)
        # 97 ids, 2 copies and a stranger: the total is known (XLEN) before reading.
        assert progress.lines[-1].startswith("verify: 100/100 entries read (100 %)"), \
            progress.lines
        assert (v.expected, v.present, v.missing) == (100, 97, 3)
        assert v.missing_sample == [record_id(7), record_id(8), record_id(9)]
        assert (v.duplicated_ids, v.extra_copies, v.unexpected) == (2, 2, 1)
        assert not v.ok
        fleet.brokers["broker-b"].kill()
        v = verify(spark, expected, refs, "v")
        assert "broker-b" in v.unreachable and not v.ok
        a.close()
        b.close()


# -- the end-to-end run -------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_end_to_end_kill_and_stop_brokers_mid_run(
    spark: SparkSession, detour: str, tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    from pyspark.sql import functions as F

    topic = "e2e"
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    generate(spark, RECORDS, src, "parquet", partitions=4)
    replayed_before = _journal_replayed(detour)
    with Fleet(4, topic, 4) as fleet:
        fleet.register(detour)
        # Pacing (1,000 records/s per partition, 2 at a time) stretches the run to ~10 s so
        # both faults land mid-run; the triggers count messages already on the brokers.
        runner = fleet.faults(["kill:broker-b@4000r", "stop:broker-c@9000r+5"]).start()
        try:
            summary = produce(spark, read_input(spark, src),
                              ProduceOptions(detour, topic, rate=1000.0, run_id="e2e"), out,
                              partitions=4)
            assert runner.wait(15), f"fault schedule unfinished: {runner.events}"
        finally:
            runner.stop()
        events = {e.action: e for e in runner.events}
        assert set(events) == {"kill", "stop", "cont"}, runner.events
        assert all(e.error is None for e in runner.events), runner.events

        # Detour's table: the killed broker is avoided (an isolation: 600 s).
        table = httpx.get(f"{detour}/fault-items", timeout=5).json()
        items = {i["brokerName"]: i for i in table["items"]}
        assert items["broker-b"]["available"] is False
        assert items["broker-b"]["availableAt"] - table["now"] > 500_000

        # Nothing lost: restart the crashed broker on its port (its AOF) and read every stream.
        fleet.brokers["broker-b"].restart()
        v = verify(spark, read_input(spark, src), brokers_from_detour(detour, topic), topic)
        assert v.ok and v.missing == 0 and v.present == RECORDS, v.table()

    results = spark.read.parquet(out).cache()
    kill_ms, stop_ms, cont_ms = (events[a].at_ms for a in ("kill", "stop", "cont"))
    during_kill = results.where(F.col("started_at") >= kill_ms).count()
    during_stop = results.where(F.col("started_at").between(stop_ms, cont_ms)).count()
    failed = dict(
        results.select(F.explode("failed_brokers").alias("b")).groupBy("b").count().collect()
    )
    failed_b, failed_c = failed.get("broker-b", 0), failed.get("broker-c", 0)
    expected_during_stop = 0.0
    for _partition, first, last, sent in results.groupBy("partition").agg(
        F.min("started_at"), F.max("started_at"), F.count("*")
    ).collect():
        overlap_ms = min(last, cont_ms) - max(first, stop_ms)
        if overlap_ms > 0 and last > first:
            expected_during_stop += sent / (last - first) * overlap_ms
    facts = {
        "records": summary.records, "failed_records": summary.failed,
        "failed_attempts": summary.failed_attempts, "failed_on_killed": failed_b,
        "sent_while_killed": during_kill, "failed_on_stopped": failed_c,
        "sent_while_stopped": during_stop,
        "expected_while_stopped": round(expected_during_stop), "duplicates": v.extra_copies,
        "avoided_selections": summary.avoided_selections, "p99_ms": round(summary.p99_ms, 2),
        "records_per_s": round(summary.records_per_s), **summary.client,
    }
    for k, val in facts.items():
        record_property(k, val)
    print("end-to-end:", facts)
    assert summary.records == RECORDS and summary.failed == 0
    # Out of the box no healthy broker is starved: the two that were never faulty each
    # carried at least half of a fair quarter (a cold first send, one producer's noise,
    # steers its own partition only: latencyQuorum 2 of the recommended profile).
    fair = RECORDS / 4
    for healthy in ("broker-a", "broker-d"):
        assert summary.per_broker.get(healthy, 0) >= 0.5 * fair, (healthy, summary.per_broker)
    # Both faults were mid-run: records went out before and after each, and all through
    # the stop at no less than half the rate the partitions then sending sent at over their
    # own runs (a busy machine sends fewer a second: the rate is its). Per partition, since
    # the stop may span the change from the first two partitions to the last two (new
    # Python workers, each client's first snapshot): no partition sends then, and that is
    # Spark, not the stop. Against the run's mean rate (which counts that change once), a
    # busy machine's stop window once held 0.49 of it: 1,385 records in 5 s at 566 a second.
    assert during_kill > 5000, facts
    assert results.where(F.col("started_at") < stop_ms).count() > 0, facts
    assert results.where(F.col("started_at") > cont_ms).count() > 0, facts
    assert during_stop >= 0.5 * expected_during_stop > 0, facts
    # Round-robin would fail about a quarter of those sends; Detour fails a handful
    # (one per partition that met the broker before the first report reached it).
    assert failed_b <= 0.02 * during_kill, facts
    assert failed_c <= 0.02 * during_stop, facts
    assert summary.failed_attempts == failed_b + failed_c + failed.get("broker-a", 0) + \
        failed.get("broker-d", 0)

    # The latency log has every attempt of this run exactly once, with who made it; the
    # analysis sees the faults. Exactly once although, on a busy machine, a batch whose
    # answer timed out is sent again whole and a report whose Redis call timed out after
    # Redis ran it is journaled and replayed: both carry their identity (docs/reliability.md).
    log = tmp_path / "latency.parquet"
    attempts = results.agg(F.sum("attempts")).first()[0]  # type: ignore[index]
    exported = _export_once(detour, log, lambda e: e.rows >= attempts, page=5000,
                            scope=RunScope.parse(out))
    record_property("log_entries", exported.rows)
    assert summary.run_id == exported.run_id == "e2e"
    resent = (summary.client["detour_failures"] * MAX_BATCH
              + _journal_replayed(detour) - replayed_before)
    assert exported.rows == attempts, (exported.rows, attempts, resent)
    producers = pq.read_table(log, columns=["producer"]).column(0).to_pylist()
    assert {p.split("/", 1)[0] for p in producers} == {"e2e"}
    faults = [{"at_ms": e.at_ms, "action": e.action, "broker": e.broker}
              for e in runner.events]
    a = analyze(spark, str(log), out=tmp_path / "report", faults=faults)
    # What Detour moved: not in the log (those sends went elsewhere), estimated from it as
    # the avoided brokers' share of the sends made while they were avoided. Here broker-b
    # from its first failure to the end (a 600 s window), broker-c likewise: at least a
    # quarter of the sends after each; more if the replay finds slow sends' windows too.
    # The replay of the sends that happened finds next to none inside a window.
    moved = a.table(a.current)["moved_selects"]
    # A broker avoided before any send to it failed (the in-flight signals of the
    # recommended profile can see a stopped broker first) is counted from its fault.
    fault_at = {"broker-b": kill_ms, "broker-c": stop_ms}
    first_fail = {b: results.where(F.array_contains("failed_brokers", b))
                  .agg(F.min("started_at")).first()[0] or at for b, at in fault_at.items()}
    share = sum(results.where(F.col("started_at") >= at).count() / 4
                for at in first_fail.values())
    record_property("moved_elsewhere_estimate", moved)
    record_property("moved_elsewhere_from_faults", share)
    # (Above the share when the replay also opens windows for slow sends on the others.)
    assert 0.8 * share <= moved <= 2 * share, (moved, share, summary.per_broker)
    assert a.table(a.current)["avoided_selects"] < 0.1 * moved
    report = (tmp_path / "report" / "report.md").read_text()
    assert f"| {moved:,.0f} |" in report
    # No --window: at most 30 windows over the run's span, whatever its length.
    assert a.window_ms == auto_window_s(a.end_ms - a.start_ms) * 1000
    assert len({w["window_start"] for w in a.windows}) <= 31
    assert a.broker("broker-b")["isolations"] >= failed_b
    assert a.broker("broker-b")["avoided_ms"] > 0
    assert [label for _, label in fault_marks(a)] == [
        f"{e.action} {e.broker}" for e in runner.events]
    for name in ("report.md", "latency.png", "avoided.png", "histogram.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    results.unpersist()


@pytest.mark.spark
@pytest.mark.slow
def test_reports_carry_the_partition_as_producer(spark: SparkSession, tmp_path: Path) -> None:
    store = RedisServer()
    svc = ServiceProcess(redis_url=store.url, env=PATIENT_ENV)
    try:
        with Fleet(2, "who", 1) as fleet:
            fleet.register(svc.url)
            records = spark.createDataFrame([(record_id(i), "x") for i in range(300)],
                                            "id string, payload string")
            produce(spark, records, ProduceOptions(svc.url, "who"), str(tmp_path / "out"),
                    partitions=3)
        def three(_: Export) -> bool:
            producers = pq.read_table(tmp_path / "log.parquet", columns=["producer"]).column(0)
            return {p.rsplit("/", 1)[-1] for p in producers.to_pylist()} == {"p0", "p1", "p2"}

        _export_once(svc.url, tmp_path / "log.parquet", three)
        assert three(export(svc.url, tmp_path / "log.parquet"))
    finally:
        svc.stop()
        store.stop()


@pytest.mark.spark
@pytest.mark.slow
def test_progress_line_moves_while_records_are_sent(
    spark: SparkSession, detour: str, tmp_path: Path
) -> None:
    """The driver's line counts records as they go (not as tasks end) and names the broker
    every select is passing over."""
    with Fleet(2, "prog", 2, persist=False) as fleet:
        fleet.register(detour)
        httpx.post(f"{detour}/report-latency", timeout=5, json={
            "brokerName": "broker-b", "latencyMs": 0, "isolation": True}).raise_for_status()
        records = spark.createDataFrame([(record_id(i), "x") for i in range(1600)],
                                        "id string, payload string")
        progress = Progress("produce", "records", spark.sparkContext,
                            failures="failed attempts", out=io.StringIO(), every_s=0.2)
        # 400 records/s in each of 2 partitions: about 2 s of sending.
        summary = produce(spark, records, ProduceOptions(detour, "prog", rate=400.0),
                          str(tmp_path / "out"), partitions=2, progress=progress)
    assert summary.delivered == 1600
    counts = [int(m.group(1).replace(",", "")) for line in progress.lines
              if (m := re.match(r"produce: ([\d,]+)/1,600 records", line))]
    # What it is doing before the first count, then counts only.
    assert progress.lines[0] == "produce: counting the input's records", progress.lines
    assert re.fullmatch(r"produce: sending 1,600 records, run run-\S+", progress.lines[1])
    assert len(counts) == len(progress.lines) - 2 >= 3, progress.lines
    assert counts == sorted(counts) and counts[-1] == 1600
    # A task ends with 800 records: any other count in between came while it was sending.
    assert any(c not in (0, 800, 1600) for c in counts), progress.lines
    assert any("avoiding broker-b" in line for line in progress.lines), progress.lines
    assert progress.lines[-1].startswith("produce: 1,600/1,600 records (100 %) · "), \
        progress.lines[-1]
    # Its rate is the summary's: records over the time from the first send to the last.
    m = re.search(r" · ([\d,]+)/s over ([\d.]+) s sending \(", progress.lines[-1])
    assert m, progress.lines[-1]
    assert int(m.group(1).replace(",", "")) == round(summary.records_per_s), \
        (progress.lines[-1], summary.records_per_s)
    assert float(m.group(2)) == round(summary.send_seconds, 1)
    # A periodic line only when its counts, tasks or brokers changed: rates and ETAs aside,
    # no two in a row say the same (the last line is the summary, printed regardless).
    said = [re.sub(r" · [\d,]+/s| · ETA .*| · finishing", "", line)
            for line in progress.lines[2:-1]]
    assert all(x != y for x, y in zip(said, said[1:], strict=False)), progress.lines
    assert not [line for line in progress.lines if " 0/1,600 " in line], progress.lines


# -- runs do not bleed into each other ---------------------------------------------------


COLD_RECORDS = 4_000


def _cold_run(
    spark: SparkSession, detour: str, tmp_path: Path, quorum: int
) -> tuple[dict[str, int], list[str]]:
    """One produce run on a fresh fleet whose broker-d answers its very first reply 0.8 s
    late (a stand-in's cold start, met by one partition only), under ``latencyQuorum``;
    the records delivered per broker, and the windows the run opened for everyone."""
    topic = f"cold-{quorum}"
    src, out = str(tmp_path / f"in-{quorum}"), str(tmp_path / f"out-{quorum}")
    generate(spark, COLD_RECORDS, src, "parquet", partitions=4)
    records = read_input(spark, src)
    since = httpx.get(f"{detour}/events", params={"latest": "true", "limit": 1},
                      timeout=5).json()["events"]
    httpx.patch(f"{detour}/config", json={"profile": "rocketmq-4", "latencyQuorum": quorum},
                timeout=5).raise_for_status()
    with Fleet(4, topic, 4) as fleet:
        fleet.register(detour)
        proxy = DelayProxy(fleet.brokers["broker-d"].port)
        try:
            proxy.hold_first_s = 0.8
            body = fleet.route()
            for b in body["brokers"]:
                if b["brokerName"] == "broker-d":
                    b["address"] = f"127.0.0.1:{proxy.port}"
            httpx.put(f"{detour}/routes/{topic}", json=body, timeout=5).raise_for_status()
            # 250 records/s per partition: about 8 s of sending, far less than the 30 s
            # window the cold answer's tier (550 ms) opens. The broker timeout is above
            # the cold answer, so it is a slow success, not a failure.
            opts = ProduceOptions(detour, topic, rate=250.0, broker_timeout=2.0,
                                  deadline=5.0, run_id=f"cold{quorum}")
            summary = produce(spark, records, opts, out, partitions=4)
            assert proxy.held == 1, "the cold first answer never happened"
            params = {"since": since[0]["id"]} if since else {}
            events = httpx.get(f"{detour}/events", params={**params, "limit": 1000},
                               timeout=5).json()["events"]
        finally:
            proxy.close()
            for name in fleet.brokers:
                httpx.delete(f"{detour}/fault-items/{name}", timeout=5)
    assert summary.records == COLD_RECORDS and summary.failed == 0
    opened = [f"{e['brokerName']} {e['kind']}/{e['reason']} tier {e['tierMs']} by "
              f"{e['reporters']}" for e in events if e["kind"] in ("opened", "quorum")]
    return summary.per_broker, opened


@pytest.mark.spark
@pytest.mark.slow
def test_a_cold_first_send_no_longer_starves_a_broker(
    spark: SparkSession, detour: str, tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    """Issue 18's starvation: one partition's cold first send to broker-d (0.8 s) opened
    a 30 s window for every partition. With latencyQuorum 2 only that partition keeps
    away from broker-d; the others keep sending to it."""
    try:
        before, opened_before = _cold_run(spark, detour, tmp_path, 1)
        after, opened_after = _cold_run(spark, detour, tmp_path, 2)
    finally:
        httpx.patch(f"{detour}/config", json={"profile": "recommended"}, timeout=5)
    record_property("per_broker_quorum_1", before)
    record_property("per_broker_quorum_2", after)
    print("cold first send, per broker: latencyQuorum 1", before, opened_before,
          "latencyQuorum 2", after, opened_after)
    assert any(o.startswith("broker-d opened/latency") for o in opened_before), opened_before
    # a single slow answer no longer opens a window for everyone (a quorum of two may)
    assert not any("opened/latency" in o for o in opened_after), opened_after
    fair = COLD_RECORDS / 4
    # RocketMQ's rule on a shared table: broker-d starved for the whole run.
    assert before.get("broker-d", 0) < 0.2 * fair, before
    # Three of four partitions still use it (3/16 of the records when partitions are equal).
    assert after.get("broker-d", 0) > 0.5 * fair, after


@pytest.mark.integration
def test_a_new_fleet_forgets_the_windows_of_an_earlier_one(detour: str) -> None:
    """Names are reused run after run; the processes are new, so their windows go."""

    def isolate(broker: str) -> None:
        httpx.post(f"{detour}/report-latency", timeout=5, json={
            "brokerName": broker, "latencyMs": 0, "isolation": True}).raise_for_status()

    def avoided() -> set[str]:
        table = httpx.get(f"{detour}/fault-items", timeout=5).json()["items"]
        return {i["brokerName"] for i in table if not i["available"]}

    isolate("broker-a")
    with Fleet(2, "fresh", 1, persist=False) as fleet:
        fleet.register(detour, forget=False)  # --keep-faults
        assert "broker-a" in avoided()
        fleet.register(detour)
        assert "broker-a" in fleet.forgotten
        assert not avoided() & {"broker-a", "broker-b"}


@pytest.mark.integration
def test_the_export_keeps_one_run(detour: str, tmp_path: Path) -> None:
    """The log holds every run; an export scoped to a run keeps its reports only."""
    reports = [{"brokerName": "broker-a", "latencyMs": i, "producer": f"{run}/h/1/p{i % 2}"}
               for i in range(6) for run in ("run-x", "run-y")]
    reports.append({"brokerName": "broker-a", "latencyMs": 1, "producer": "not-a-run"})
    httpx.post(f"{detour}/report-latency:batch", json={"reports": reports},
               timeout=5).raise_for_status()
    result = _export_once(detour, tmp_path / "x.parquet", lambda e: e.rows >= 6,
                          scope=RunScope("run-x"))
    table = pq.read_table(tmp_path / "x.parquet")
    # (entries scanned: a replica's histogram of a producer's reports is one entry)
    assert result.rows == table.num_rows == 6 and result.scanned >= 6
    assert set(table.column("producer").to_pylist()) == {"run-x/h/1/p0", "run-x/h/1/p1"}

    # From a produce output: its _summary.json names the run and when it sent.
    now = int(time.time() * 1000)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "_summary.json").write_text(json.dumps(
        {"run_id": "run-y", "started_ms": now - 5000, "ended_ms": now}))
    scope = RunScope.parse(str(tmp_path / "out"))
    assert scope == RunScope("run-y", now - 5000, now)
    assert export(detour, tmp_path / "y.parquet", scope=scope).rows == 6
    # A run that starts later than anything in the log: nothing before it is even read.
    later = RunScope("run-y", now + 2 * RunScope.SLACK_MS, now + 3 * RunScope.SLACK_MS)
    assert export(detour, tmp_path / "z.parquet", scope=later).scanned == 0
    with pytest.raises(ValueError):
        RunScope.parse(str(tmp_path / "no-such-dir" / "x"))


# -- the analysis on a log with known percentiles -------------------------------------------

T0 = 1_800_000_000_000
MIN = 60_000


def synthetic_log() -> list[dict[str, object]]:
    """broker-a: 0..1000 ms once each; broker-c: 0..2000 ms; broker-b: 10 and 5 ms sends
    around one failure at +120 s (scenario of test_pipeline_analyze)."""
    entries: list[dict[str, object]] = []

    def add(broker: str, at: int, latency: int, isolation: bool = False) -> None:
        entries.append({"id": f"{at}-{len(entries)}", "brokerName": broker,
                        "latencyMs": latency, "isolation": isolation,
                        "producer": "synthetic", "at": at})

    for i in range(1001):
        add("broker-a", T0 + i * 50, (i * 7919) % 1001)
    for i in range(2001):
        add("broker-c", T0 + i * 149 if i < 2000 else T0 + 5 * MIN - 1, (i * 7919) % 2001)
    for i in range(100):
        add("broker-b", T0 + MIN + i * 100, 10)
    add("broker-b", T0 + 2 * MIN, 200, True)
    for i in range(50):
        add("broker-b", T0 + 150_000 + i * 1000, 5)
    return entries


@pytest.mark.spark
@pytest.mark.slow
def test_analysis_returns_known_percentiles(spark: SparkSession, tmp_path: Path) -> None:
    entries = synthetic_log()
    log = tmp_path / "log.parquet"
    pq.write_table(to_table(entries), log)
    strict = TierTable.parse("strict=5,10:0,60000")
    a = analyze(spark, str(log), window_s=60, alternatives=[strict], out=tmp_path / "r")

    def pcts(broker: str) -> tuple[float, float, float]:
        b = a.broker(broker)
        return (b["p50"], b["p90"], b["p99"])

    assert pcts("broker-a") == (500, 900, 990)
    assert pcts("broker-c") == (1000, 1800, 1980)
    assert pcts("broker-b") == (10, 10, 10)
    assert [a.broker(b)["isolations"] for b in ("broker-a", "broker-b", "broker-c")] == [0, 1, 0]
    assert a.window("broker-a", T0)["p50"] == 500 and a.window("broker-a", T0)["max"] == 1000
    assert a.window("broker-b", T0 + 2 * MIN)["isolations"] == 1
    # broker-b: avoided from its failure (+120 s) to the log's end (+300 s), RocketMQ tiers.
    assert a.broker("broker-b")["avoided_ms"] == 180_000
    assert [a.window("broker-b", T0 + k * MIN)["avoided_ms"] for k in (1, 2, 3, 4)] == \
        [0, MIN, MIN, MIN]

    # The job's replay is the pure replay, per table, summed over brokers.
    per_broker: dict[str, list[tuple[int, int, bool]]] = {}
    for e in entries:
        per_broker.setdefault(str(e["brokerName"]), []).append(
            (int(e["at"]), int(e["latencyMs"]), bool(e["isolation"])))  # type: ignore[call-overload]
    for table in (TierTable("rocketmq"), strict):
        expected = sum(w.avoided_selects for rs in per_broker.values()
                       for w in replay(rs, table, MIN, T0, T0 + 5 * MIN).values())
        assert a.table(table.name)["avoided_selects"] == expected
        # ... and so is the estimate of the selects its windows moved elsewhere.
        spans = {b: s for b, rs in per_broker.items()
                 if (s := avoided_spans(rs, table, T0, T0 + 5 * MIN))}
        sends = [(str(e["brokerName"]), int(e["at"]) - int(e["latencyMs"]))  # type: ignore[call-overload]
                 for e in entries]
        assert a.table(table.name)["moved_selects"] == round(moved_elsewhere(sends, spans, 3), 1)
    assert a.table("rocketmq")["moved_selects"] > 0

    # The recommendation: pooled percentiles of successful sends, then the rule.
    ok = np.array([e["latencyMs"] for e in entries if not e["isolation"]], dtype=float)
    assert a.pooled["p50"] == pytest.approx(np.percentile(ok, 50))
    assert a.pooled["p99"] == pytest.approx(np.percentile(ok, 99))
    baseline = a.candidates[0]  # the failure tier alone: broker-b's 50 sends after it
    assert baseline["name"] == "failures-only" and baseline["avoided_ok"] == 50
    budget = 0.01 * len(ok) + baseline["avoided_ok"]
    first_ok = next(c for c in a.candidates[1:] if c["avoided_ok"] <= budget)
    assert a.recommendation["factor"] == first_ok["name"]
    factor = float(first_ok["name"].lstrip("x"))
    # the percentiles read at the log's bucket resolution (most reports reach it as
    # histograms: docs/semantics.md)
    rule = recommend(log_resolution(a.pooled["p50"]), log_resolution(a.pooled["p99"]),
                     factor=factor)
    assert a.recommendation["latencyMax"] == list(rule.latency_max)
    assert a.recommendation["notAvailableDuration"] == list(rule.durations)
    report = (tmp_path / "r" / "report.md").read_text()
    assert "| broker-a | 1001 | 0 | 500.0 | 900.0 | 990.0 |" in report
    assert "avoided s (all brokers)" in report and "broker-s" not in report
    assert '"latencyMax": ' + str(list(rule.latency_max)) in report
