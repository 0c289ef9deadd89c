"""A stop that lands inside a store call still stops the loops that talk to the store."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from detour.model import Config
from service import detector
from service.cancelling import honour_cancel
from service.store.memory import MemoryStore

pytestmark = pytest.mark.unit


class SwallowingStore(MemoryStore):
    """A store whose lease call drops a cancel that lands while it runs, as redis-py's
    ``asyncio.wait_for`` does on Python 3.11 when the cancel meets the reply."""

    def __init__(self) -> None:
        super().__init__()
        self.leases = 0
        self.in_call = asyncio.Event()

    async def detector_lease(self, ttl_ms: int) -> bool:
        self.leases += 1
        self.in_call.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass  # swallowed; the task still counts the request
        return False


def test_honour_cancel_raises_only_a_requested_cancel() -> None:
    raised: list[bool] = []

    async def child() -> None:
        honour_cancel()  # nothing requested: no-op
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # requested, as if a library call had swallowed its delivery
        try:
            honour_cancel()
        except asyncio.CancelledError:
            raised.append(True)
            raise

    async def scenario() -> None:
        task = asyncio.create_task(child())
        await asyncio.wait({task}, timeout=5)
        assert task.cancelled()

    asyncio.run(scenario())
    assert raised == [True]


def test_the_detector_stops_when_its_cancel_was_swallowed_by_a_store_call() -> None:
    async def scenario() -> None:
        store = SwallowingStore()
        await store.put_config(replace(Config(), detector_enable=True, detect_interval_ms=100))
        task = asyncio.create_task(detector.run(store))
        await asyncio.wait_for(store.in_call.wait(), 5)
        task.cancel()  # lands inside the lease call, which drops it
        done, _ = await asyncio.wait({task}, timeout=5)
        assert done == {task} and task.cancelled()
        assert store.leases == 1  # no second round after the stop

    asyncio.run(scenario())
