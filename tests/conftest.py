"""Shared fixtures: a real redis-server per session, apps on both stores, live service processes."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from service.app import create_app
from service.settings import Settings
from tests.asgi_client import TestClient
from tests.procs import PATIENT_CALL_TIMEOUT_S, PATIENT_ENV, RedisServer, ServiceProcess

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# The suite checks RocketMQ 4.x's semantics (docs/semantics.md) and each policy knob on top
# of them, so every table it starts (in this process, in the services and Spark executors
# it starts) begins as exact RocketMQ: the ``rocketmq-4`` profile. What a table starts with
# out of the box (``recommended``) is tested where it is the point: tests/test_profiles.py.
os.environ.setdefault("DETOUR_PROFILE", "rocketmq-4")

# GET /metrics renders at most once per DETOUR_METRICS_CACHE_S (1 s): a scrape within a
# second of the last rendering waits for the next. Many tests read a counter before and
# after what they do, and would wait a second each time; only test_bounds' scrape test is
# about the rate, and it sets its own.
os.environ.setdefault("DETOUR_METRICS_CACHE_S", "0")

# Every JVM the suite starts (Spark's drivers, spark-submit, the Java example) lives for
# seconds: its JIT's optimising tier costs more CPU than it saves (about 40% of
# spark-submit's CPU here), and on a 2-core machine that CPU is the suite's wall time.
# Only how fast the JVM runs changes, not what it does.
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")

# Service processes are forked from one that has imported the service once per worker,
# instead of each importing it again (about 1.5 s of CPU a start; tests/forkserver.py).
os.environ.setdefault("TESTS_FORK_SERVICES", "1")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A flushed Redis for each test."""
    with redis_server.client() as c:
        c.flushall()
    yield redis_server.url


@pytest.fixture(scope="module")
def service() -> Iterator[ServiceProcess]:
    """Detour as its own process on the memory store, one per test module."""
    with ServiceProcess() as svc:
        yield svc


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@functools.cache
def _environment_settings() -> Settings:
    """What the environment says, read once: reading it takes pydantic-settings a few ms
    (every field against every source), and the suite asks for settings thousands of times."""
    return Settings()


@pytest.fixture
def settings(store_kind: str, request: pytest.FixtureRequest) -> Settings:
    if store_kind == "redis":
        url = request.getfixturevalue("redis_url")
        # No test of this suite is about the report timeout (procs.PATIENT_CALL_TIMEOUT_S).
        return _environment_settings().model_copy(
            update={"redis_url": url, "redis_call_timeout_s": PATIENT_CALL_TIMEOUT_S})
    return _environment_settings().model_copy()


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    """The app on the parametrized store, lifespan running."""
    with TestClient(create_app(settings)) as c:
        yield c


#: Files that take minutes (Spark, schemathesis, real builds, many processes), by one run's
#: ``--durations``: scheduled first, so that the workers of ``make test`` (``--dist
#: loadfile --no-loadscope-reorder``: a file stays on one worker, in this order) end
#: together instead of one of them starting a Spark suite when the others are done.
LONGEST_FIRST = (
    "test_pipeline.py",
    "test_pipeline_cli.py",
    "test_schemathesis.py",
    "test_scenario_integrity.py",
    "test_examples.py",
    "test_sdk_dist.py",
    "test_metrics.py",
    "test_differential.py",
    "test_scenario_redis_loss.py",
    "test_bounds.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long files first, then the others by their number of tests (what xdist's own
    reordering does); a file's tests keep their order."""
    count: dict[str, int] = {}
    for item in items:
        count[item.path.name] = count.get(item.path.name, 0) + 1

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        if name in LONGEST_FIRST:
            return (LONGEST_FIRST.index(name), 0)
        return (len(LONGEST_FIRST), -count[name])

    items.sort(key=rank)


# -- the Spark suites (tests/test_pipeline*.py): one SparkSession for both, one Detour per module --

#: The files that drive a SparkSession. Under xdist they form one unit of work (the
#: scheduler below), so that one worker starts one JVM for both: a SparkSession's start
#: is the most expensive set-up in the suite (tests/README.md has the figures).
SPARK_FILES = ("test_pipeline.py", "test_pipeline_cli.py")

_spark: list[SparkSession] = []


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile`` with the Spark files as one unit; any other mode is xdist's."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SparkFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "spark" if scope.rpartition("/")[2] in SPARK_FILES else scope

    return SparkFilesTogether(config, log)  # type: ignore[arg-type]


def _stop_spark() -> None:
    while _spark:
        _spark.pop().stop()


@pytest.fixture
def spark() -> SparkSession:
    """The worker's SparkSession, started by the first test that asks for it and stopped
    after the last test of the Spark files (``pytest_runtest_teardown``)."""
    if not _spark:
        from pipeline import spark_session

        session = spark_session(
            "detour-pipeline-tests",
            "local[2]",
            {
                "spark.sql.shuffle.partitions": "2",
                "spark.ui.enabled": "false",
                "spark.ui.showConsoleProgress": "false",
            },
        )
        session.sparkContext.setLogLevel("ERROR")
        _spark.append(session)
    return _spark[0]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the SparkSession once the tests that come next are none of the Spark files'."""
    if _spark and (nextitem is None or nextitem.path.name not in SPARK_FILES):
        _stop_spark()


def pytest_sessionfinish() -> None:
    _stop_spark()


@pytest.fixture(scope="module")
def detour() -> Iterator[str]:
    """Detour on its own Redis: the shared table every partition's client talks to. The
    faults here are the brokers'; Detour's Redis is healthy, so its report timeout is a
    patient one (procs.PATIENT_ENV). Its table starts as docs/spark.md's walkthrough's
    does, out of the box: the ``recommended`` profile."""
    store = RedisServer()
    try:
        svc = ServiceProcess(redis_url=store.url,
                             env={**PATIENT_ENV, "DETOUR_PROFILE": "recommended"})
        try:
            yield svc.url
        finally:
            svc.stop()
    finally:
        store.stop()
