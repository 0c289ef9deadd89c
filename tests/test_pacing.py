"""The batch pacer (service/api/pacing.py): one batch per namespace at a time, a bounded
wait for the turn, and pauses between chunks only while other requests arrive."""

from __future__ import annotations

import asyncio
import time

import pytest

from service.api import pacing
from service.api.pacing import BatchPacer
from service.errors import Busy

pytestmark = pytest.mark.unit


def test_a_namespaces_second_batch_waits_its_turn_and_is_refused_past_the_bound() -> None:
    async def scenario() -> None:
        pacer = BatchPacer()
        holding, release = asyncio.Event(), asyncio.Event()

        async def first() -> None:
            async with pacer.turn("a"):
                holding.set()
                await release.wait()

        task = asyncio.create_task(first())
        await holding.wait()
        async with pacer.turn("b"):  # another namespace: not kept waiting
            pass
        start = time.monotonic()
        with pytest.raises(Busy):
            async with pacer.turn("a"):
                raise AssertionError("admitted while the first batch runs")
        assert time.monotonic() - start >= pacing.MAX_WAIT_S * 0.9
        release.set()
        await task
        async with pacer.turn("a"):  # free again
            pass

    asyncio.run(scenario())


def test_a_batch_pauses_between_chunks_only_while_others_arrive() -> None:
    async def scenario() -> None:
        arrivals = [0]
        pacer = BatchPacer(lambda: arrivals[0])
        async with pacer.turn("a") as pace:
            busy_until = time.perf_counter() + 0.02
            while time.perf_counter() < busy_until:  # a chunk's 20 ms of work
                pass
            start = time.perf_counter()
            await pace.between_chunks()  # nobody else arrived: one turn only
            assert time.perf_counter() - start < 0.015  # (a loaded machine may take a few ms)
            busy_until = time.perf_counter() + 0.02
            while time.perf_counter() < busy_until:
                pass
            arrivals[0] += 1  # another request was read meanwhile
            start = time.perf_counter()
            await pace.between_chunks()
            assert time.perf_counter() - start >= 0.018  # as long as the chunk took

    asyncio.run(scenario())
