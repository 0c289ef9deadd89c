"""Cancellation that a library call swallowed, raised where a loop can honour it.

redis-py sends every command through ``asyncio.wait_for``, which on Python 3.11
returns the result and drops a cancel that lands as the call completes; the task
still counts the request (``Task.cancelling()``). A loop that only awaits Redis
calls and sleeps then never ends, and a shutdown that cancels and awaits it hangs.
Every endless loop that talks to a store checks ``honour_cancel()`` once a round.
"""

from __future__ import annotations

import asyncio


def honour_cancel() -> None:
    """Raise the cancellation the current task was asked for but never saw."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
