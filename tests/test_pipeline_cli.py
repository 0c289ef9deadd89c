"""The pipeline's command lines and tokens for real: the spark-submit line as its own driver
process, and every call the pipeline makes to Detour with a token (Spark ``local[2]``).

Apart from tests/test_pipeline.py, for a reader; both run on one test worker, on one
SparkSession (the ``spark`` fixture and the scheduler in conftest.py).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pyarrow.parquet as pq
import pytest

from pipeline import brokers as brokers_cli
from pipeline import detour_token
from pipeline.analyze import (
    TierTable,
    fetch_config,
)
from pipeline.brokers import Fleet
from pipeline.export_log import RunScope, export
from pipeline.generate import generate, record_id
from pipeline.produce import ProduceOptions, options, produce
from pipeline.produce import _parser as produce_parser
from pipeline.verify import brokers_from_detour
from tests.procs import ROOT, ServiceProcess, write_tokens
from tests.test_pipeline import _export_once

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


# -- the command lines ----------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)  # (a hang guard: beside the hog 75-136 s, plus the session's 23-44 s)
def test_spark_submit_runs_the_producing_job(
    spark: SparkSession, detour: str, tmp_path: Path
) -> None:
    """The module docstring's spark-submit line, as a separate driver process."""
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    generate(spark, 500, src, "json", partitions=2)
    submit = Path(sys.executable).parent / "spark-submit"
    env = {k: v for k, v in os.environ.items() if k != "DETOUR_SPARK_LOG_LEVEL"}
    with Fleet(2, "cli", 2) as fleet:
        fleet.register(detour)
        run = subprocess.run(
            [str(submit), "--master", "local[2]", "--conf", "spark.ui.enabled=false",
             "--driver-java-options", "-Dlog4j2.configurationFile=pipeline/log4j2.properties",
             "pipeline/produce.py", "--input", src, "--detour", detour, "--topic", "cli",
             "--out", out, "--mode", "remote"],
            cwd=ROOT, capture_output=True, text=True, timeout=240,
            env={**env, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1",
                 "PYSPARK_DRIVER_PYTHON": sys.executable},
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert "records              500" in run.stdout
        assert "delivered            500" in run.stdout
        assert sum(fleet.brokers[n].messages("cli") for n in fleet.brokers) == 500
    assert (Path(out) / "_summary.json").exists()
    # Quiet from the JVM's first line (WARN and above), and the progress line's last word
    # (spark-submit hands the Python driver's stderr on through its stdout).
    output = run.stderr + run.stdout
    assert not [line for line in output.splitlines() if " INFO " in line], output[:3000]
    assert "produce: 500/500 records (100 %)" in output, output[-3000:]
    # The run's reports, and no other run's, from the output directory alone.
    scope = RunScope.parse(out)
    assert scope.run_id.startswith("run-") and scope.run_id in run.stdout
    exported = _export_once(detour, tmp_path / "log.parquet", lambda e: e.rows >= 500,
                            scope=scope)
    assert exported.rows >= 500


# -- tokens: every call the pipeline makes to Detour can carry one ---------------------------


@dataclass(frozen=True)
class Secured:
    url: str
    admin: str
    producer: str

    def auth(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """Detour (memory store) with a tokens file: admin ``ops``, producer ``spark``."""
    admin, producer = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    tokens = write_tokens(tmp_path_factory.mktemp("auth") / "tokens.json", {
        "ops": (admin, "admin", "pipe"), "spark": (producer, "producer", "pipe")})
    with ServiceProcess(env={"DETOUR_TOKENS_FILE": str(tokens)}) as svc:
        yield Secured(svc.url, admin, producer)


def _status(call: object) -> int:
    """The HTTP status a pipeline call failed with."""
    with pytest.raises(httpx.HTTPStatusError) as err:
        call()  # type: ignore[operator]
    return err.value.response.status_code


def test_token_comes_from_the_flag_then_the_environment(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DETOUR_TOKEN", raising=False)
    assert detour_token() is None and detour_token("f") == "f"
    monkeypatch.setenv("DETOUR_TOKEN", "env")
    assert detour_token() == "env" and detour_token("f") == "f"
    assert detour_token("") is None  # --token '' sends none even with the variable set
    monkeypatch.setenv("DETOUR_TOKEN", "")
    assert detour_token() is None
    base = ["--input", "i", "--topic", "t", "--out", "o"]
    monkeypatch.setenv("DETOUR_TOKEN", "env-secret")
    opts = options(produce_parser().parse_args(base))
    assert opts.token == "env-secret" and "env-secret" not in repr(opts)
    assert options(produce_parser().parse_args([*base, "--token", "flag"])).token == "flag"


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_export_log_needs_an_admin_token(secured: Secured, tmp_path: Path) -> None:
    reports = [{"brokerName": f"broker-{i % 2}", "latencyMs": i, "producer": "exec-1"}
               for i in range(5)]
    httpx.post(f"{secured.url}/report-latency:batch", json={"reports": reports},
               headers=secured.auth(secured.producer), timeout=5).raise_for_status()
    out = tmp_path / "log.parquet"
    assert _status(lambda: export(secured.url, out)) == 401
    assert _status(lambda: export(secured.url, out, token=secured.producer)) == 403
    result = export(secured.url, out, page=2, token=secured.admin)
    assert (result.rows, result.pages) == (5, 3)
    table = pq.read_table(out)
    assert table.column("latency_ms").to_pylist() == [0, 1, 2, 3, 4]
    # Detour records the reporting token's name in front of the producer the report gave.
    assert set(table.column("producer").to_pylist()) == {"spark/exec-1"}

    # The command line: DETOUR_TOKEN, --token over it, and a clean exit 2 without a token.
    env = {k: v for k, v in os.environ.items() if k != "DETOUR_TOKEN"}
    cmd = [sys.executable, "-m", "pipeline.export_log", "--detour", secured.url]

    def run(extra: list[str], token: str | None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cmd, *extra], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env=env if token is None
                              else {**env, "DETOUR_TOKEN": token})

    ok = run(["--out", str(tmp_path / "cli.parquet")], secured.admin)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["rows"] == 5
    assert pq.read_table(tmp_path / "cli.parquet").num_rows == 5
    # `--token=` form: a token_urlsafe token may start with "-", which argparse would read
    # as an option.
    for extra, token, status in (([], None, 401),
                                 ([f"--token={secured.producer}"], secured.admin, 403)):
        bad = run(["--out", str(tmp_path / "bad.parquet"), *extra], token)
        assert bad.returncode == 2, bad.stderr
        assert f"GET /latency-log: HTTP {status}" in bad.stderr, bad.stderr


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_routes_and_config_calls_send_the_admin_token(
    secured: Secured, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Fleet(2, "tok-route", 1, persist=False) as fleet:
        assert _status(lambda: fleet.register(secured.url)) == 401
        assert _status(lambda: fleet.register(secured.url, token=secured.producer)) == 403
        fleet.register(secured.url, token=secured.admin)
        assert _status(lambda: brokers_from_detour(secured.url, "tok-route")) == 401
        refs = brokers_from_detour(secured.url, "tok-route", token=secured.admin)
        assert {(r.name, r.address) for r in refs} == set(fleet.addresses().items())
    assert _status(lambda: fetch_config(secured.url)) == 401
    config = httpx.get(f"{secured.url}/config", headers=secured.auth(secured.admin), timeout=5)
    assert fetch_config(secured.url, secured.admin) == TierTable.from_body("current",
                                                                          config.json())

    # python -m pipeline.brokers start: the token from DETOUR_TOKEN registers the route.
    monkeypatch.setenv("DETOUR_TOKEN", secured.admin)
    lines: list[str] = []
    assert brokers_cli.main(["start", "--n", "1", "--queues", "1", "--topic", "tok-cli",
                             "--detour", secured.url, "--no-persist", "--for", "0"],
                            out=lines.append) == 0
    route = httpx.get(f"{secured.url}/routes/tok-cli", headers=secured.auth(secured.admin),
                      timeout=5)
    assert route.status_code == 200
    assert [b["brokerName"] for b in route.json()["brokers"]] == ["broker-a"]


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_produce_sends_the_token_from_every_executor(
    spark: SparkSession, secured: Secured, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's token reaches the partitions' clients (in the pickled options): every
    record delivered, and every report in the log under the producer token's name."""
    # The SDK reads no environment: the executors' clients have only the options' token.
    monkeypatch.delenv("DETOUR_TOKEN", raising=False)
    # The log so far (other tests' reports): read from after its end below.
    before = export(secured.url, tmp_path / "before.parquet", token=secured.admin).last_id
    with Fleet(2, "tok-produce", 2, persist=False) as fleet:
        fleet.register(secured.url, token=secured.admin)
        records = spark.createDataFrame([(record_id(i), "x") for i in range(200)],
                                        "id string, payload string")
        summary = produce(spark, records,
                          ProduceOptions(secured.url, "tok-produce", token=secured.producer),
                          str(tmp_path / "out"), partitions=2)
        assert (summary.records, summary.delivered, summary.failed) == (200, 200, 0)
        assert sum(fleet.brokers[n].messages("tok-produce") for n in fleet.brokers) == 200
    exported = export(secured.url, tmp_path / "log.parquet", after=before, token=secured.admin)
    assert exported.rows >= 200, exported  # every record reported at least once
    producers = set(pq.read_table(tmp_path / "log.parquet", columns=["producer"])
                    .column(0).to_pylist())
    assert {p.split("/", 1)[0] for p in producers} == {"spark"}, producers
    assert {p.rsplit("/", 1)[-1] for p in producers} == {"p0", "p1"}, producers
