"""Whole answers written when the event loop's turn has read everything, not at once.

Why: writing an answer to a loopback client that sleeps wakes it, and the wake-up is paid
in the writer's system call. Written one by one as requests are read, each answer paid
one; written at the end of the turn, a turn's answers share one wake-up (measured in
docs/BENCHMARKS.md, "Hot path"). uvicorn's own answers come
from tasks, which run after the turn's reads too.

A connection's answers keep their order: each connection sends its pending bytes before
anything else it writes or closes (``EdgeProtocol._flush_out``).
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class Writer(Protocol):
    """A connection with answers waiting (the server protocol)."""

    loop: asyncio.AbstractEventLoop

    def flush_out(self) -> None:
        """Write its pending answers now."""


class Outbox:
    """The connections with answers waiting for the end of this turn."""

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        self._waiting: list[Writer] = []

    def add(self, writer: Writer) -> None:
        if not self._waiting:
            writer.loop.call_soon(self.flush)
        self._waiting.append(writer)

    def flush(self) -> None:
        waiting, self._waiting = self._waiting, []
        for writer in waiting:
            writer.flush_out()
