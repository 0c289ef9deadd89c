"""A namespace's report batches share the replica fairly: one at a time, and at most half
of its event loop.

Why: a batch of 1,000 reports that each move a window costs the replica hundreds of
milliseconds of its one event loop (the store's scripts, then the pushes each change comes
back as), and Redis tens. Split into chunks with a turn for others between them, two of
them back to back still took most of the loop, and another namespace's single reports
waited behind them (p50 6 -> 345 ms measured on main). So a batch costs its sender: a
namespace's batches run one at a time (the next waits, costing nothing), and after each
chunk a batch pauses as long as the chunk took, so that it uses at most half of the
loop's time however much it has to do. The pacer lives in the app's state: its locks
belong to the app's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

#: The longest pause between two chunks (s): a chunk that waited long on Redis (a stall,
#: a failover) must not stall its batch for as long again.
MAX_PAUSE_S = 0.05


class BatchPacer:
    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    @asynccontextmanager
    async def turn(self, namespace: str) -> AsyncIterator[Pace]:
        """Wait for the namespace's turn; the ``Pace`` paces the batch's chunks."""
        lock = self._locks.get(namespace)
        if lock is None:
            lock = self._locks[namespace] = asyncio.Lock()
        async with lock:
            yield Pace()


class Pace:
    """Between chunks: a pause as long as the last chunk took (at most ``MAX_PAUSE_S``)."""

    def __init__(self) -> None:
        self._began = time.perf_counter()

    async def between_chunks(self) -> None:
        took = time.perf_counter() - self._began
        await asyncio.sleep(min(took, MAX_PAUSE_S))
        self._began = time.perf_counter()
