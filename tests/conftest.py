"""Shared fixtures: a real redis-server per session, apps on both stores, live service processes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.settings import Settings
from tests.procs import PATIENT_CALL_TIMEOUT_S, RedisServer, ServiceProcess

# The suite checks RocketMQ 4.x's semantics (docs/semantics.md) and each policy knob on top
# of them, so every table it starts (in this process, in the services and Spark executors
# it starts) begins as exact RocketMQ: the ``rocketmq-4`` profile. What a table starts with
# out of the box (``recommended``) is tested where it is the point: tests/test_profiles.py.
os.environ.setdefault("DETOUR_PROFILE", "rocketmq-4")


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


@pytest.fixture
def settings(store_kind: str, request: pytest.FixtureRequest) -> Settings:
    if store_kind == "redis":
        url = request.getfixturevalue("redis_url")
        # No test of this suite is about the report timeout (procs.PATIENT_CALL_TIMEOUT_S).
        return Settings(redis_url=url, redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)
    return Settings()


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    """The app on the parametrized store, lifespan running."""
    with TestClient(create_app(settings)) as c:
        yield c
