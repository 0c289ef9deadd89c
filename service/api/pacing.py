"""A namespace's report batches share the replica fairly: one at a time, and at most half
of its event loop while other requests want it.

Why: a batch of 1,000 reports that each move a window costs the replica hundreds of
milliseconds of its one event loop (the store's scripts, then the pushes each change comes
back as), and Redis tens. Split into chunks with a turn for others between them, two of
them back to back still took most of the loop, and another namespace's single reports
waited behind them (p50 6 -> 345 ms measured on main). So a batch costs its sender: a
namespace's batches run one at a time (the next waits, costing nothing), and after each
chunk during which other requests arrived, a batch pauses as long as the chunk took, so
that it uses at most half of the loop's time however much it has to do; with nobody else
asking, it only yields a turn, and keeps its pace. A batch that waits for its turn longer
than ``MAX_WAIT_S`` is refused ``503 SYSTEM_BUSY`` rather than left to its sender's
timeout: a sender that timed out sends the batch again, and the replica would then work
through copies nobody waits for (measured: a capped replica never caught up). The pacer
lives in the app's state (its locks belong to the app's event loop); ``arrivals`` counts
the requests the server has read (the edge's count, wired by service/app.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from service.errors import Busy

#: The longest pause between two chunks (s): a chunk that waited long on Redis (a stall,
#: a failover) must not stall its batch for as long again.
MAX_PAUSE_S = 0.05
#: The longest a batch waits for its namespace's turn (s), well within the SDK's 2 s for
#: a batch call.
MAX_WAIT_S = 0.5


class BatchPacer:
    def __init__(self, arrivals: Callable[[], int] = lambda: 1) -> None:
        """``arrivals``: a count of requests read that grows as they come (by default it
        never stays the same: always pause)."""
        self._locks: dict[str, asyncio.Lock] = {}
        self.arrivals = arrivals

    @asynccontextmanager
    async def turn(self, namespace: str) -> AsyncIterator[Pace]:
        """Wait for the namespace's turn; the ``Pace`` paces the batch's chunks."""
        lock = self._locks.get(namespace)
        if lock is None:
            lock = self._locks[namespace] = asyncio.Lock()
        try:
            async with asyncio.timeout(MAX_WAIT_S):
                await lock.acquire()
        except TimeoutError:
            raise Busy(
                f"another batch of namespace {namespace!r} is being applied: retry shortly"
            ) from None
        try:
            yield Pace(self.arrivals)
        finally:
            lock.release()


class Pace:
    """Between chunks: a pause as long as the last chunk took (at most ``MAX_PAUSE_S``) if
    other requests arrived meanwhile, else one turn of the loop."""

    def __init__(self, arrivals: Callable[[], int]) -> None:
        self._arrivals = arrivals
        self._seen = arrivals()
        self._began = time.perf_counter()

    async def between_chunks(self) -> None:
        took = time.perf_counter() - self._began
        seen = self._arrivals()
        await asyncio.sleep(min(took, MAX_PAUSE_S) if seen != self._seen else 0)
        self._seen = self._arrivals()
        self._began = time.perf_counter()
