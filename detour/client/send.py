"""RocketMQ's synchronous send loop (``DefaultMQProducerImpl.sendDefaultImpl``) over Detour.

    for times in range(1 + retries):
        if times and cost > timeout: break       # no new attempt after the deadline
        mq = select(topic, lastBrokerName)        # the broker of the previous attempt
        begin = now()
        try: deliver(mq, msg)                     # the user's send to the broker
        except: report(mq.broker, now() - begin, isolation=True); continue
        report(mq.broker, now() - begin, isolation=False); return

Every attempt is reported, measured on the monotonic clock around ``deliver``
only (as RocketMQ measures ``sendKernelImpl``), so a wall-clock step never
turns into a fake latency. The deadline bounds the whole message: no attempt
starts after it, and the async loop also cuts ``deliver`` at the time left.

An exception listed in ``no_retry`` means the message, not the broker, is at
fault (too large, refused by a check): the loop stops at once and the attempt
is reported as a plain latency, so a healthy broker is not isolated for every
producer because of one bad message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from detour.client.errors import DetourClientError, DetourRequestError, SendError
from detour.client.values import Attempt, SelectedQueue, SendResult

log = logging.getLogger("detour.client")

P = TypeVar("P")
R = TypeVar("R")

ExcTypes = tuple[type[BaseException], ...]


def _ms_since(start_ns: int) -> float:
    return (time.monotonic_ns() - start_ns) / 1_000_000


def _select_failed(topic: str, attempts: list[Attempt], exc: DetourClientError) -> BaseException:
    """A select that fails mid-loop ends the send; before any attempt its error is the answer."""
    if not attempts:
        return exc
    return SendError(topic, attempts, timed_out=False)


def _safe_report(
    report: Callable[[str, float, bool], None], q: SelectedQueue, ms: float, iso: bool
) -> None:
    # A report that cannot be made (a 4xx) must not fail a send that went through.
    try:
        report(q.broker_name, ms, iso)
    except DetourRequestError as exc:
        log.warning("detour refused a report for %s: %s", q.broker_name, exc)


def send_sync(
    topic: str,
    payload: P,
    deliver: Callable[[SelectedQueue, P], R],
    *,
    select: Callable[[str, str | None], SelectedQueue],
    report: Callable[[str, float, bool], None],
    retries: int,
    deadline: float,
    no_retry: ExcTypes = (),
) -> SendResult[R]:
    """The loop for a blocking ``deliver``; see the module docstring.

    Raises SendError when no attempt succeeded (``timed_out`` when the deadline
    stopped it), or the select's DetourClientError when no attempt could start.
    """
    start = time.monotonic_ns()
    limit_ns = int(deadline * 1e9)
    attempts: list[Attempt] = []
    last_broker: str | None = None
    for times in range(1 + retries):
        if times and time.monotonic_ns() - start >= limit_ns:
            raise SendError(topic, attempts, timed_out=True) from attempts[-1].error
        try:
            queue = select(topic, last_broker)
        except DetourClientError as exc:
            raise _select_failed(topic, attempts, exc) from exc
        begin = time.monotonic_ns()
        try:
            value = deliver(queue, payload)
        except no_retry as exc:
            ms = _ms_since(begin)
            _safe_report(report, queue, ms, False)
            attempts.append(Attempt(queue, ms, exc))
            raise SendError(topic, attempts, timed_out=False) from exc
        except Exception as exc:  # noqa: BLE001 - any delivery failure is the broker's
            ms = _ms_since(begin)
            _safe_report(report, queue, ms, True)
            attempts.append(Attempt(queue, ms, exc))
            last_broker = queue.broker_name
            continue
        ms = _ms_since(begin)
        _safe_report(report, queue, ms, False)
        attempts.append(Attempt(queue, ms, None))
        return SendResult(queue, attempts, value)
    raise SendError(topic, attempts, timed_out=False) from attempts[-1].error


async def send_async(
    topic: str,
    payload: P,
    deliver: Callable[[SelectedQueue, P], Awaitable[R]],
    *,
    select: Callable[[str, str | None], Awaitable[SelectedQueue]],
    report: Callable[[str, float, bool], Awaitable[None]],
    retries: int,
    deadline: float,
    no_retry: ExcTypes = (),
) -> SendResult[R]:
    """The loop for an async ``deliver``, each call cut at the deadline's time left.

    A ``deliver`` cut by the deadline fails with TimeoutError (reported as an
    isolation, as RocketMQ treats a send timeout). Raises as ``send_sync``.
    """
    start = time.monotonic_ns()
    limit_ns = int(deadline * 1e9)
    attempts: list[Attempt] = []
    last_broker: str | None = None

    async def safe_report(q: SelectedQueue, ms: float, iso: bool) -> None:
        try:
            await report(q.broker_name, ms, iso)
        except DetourRequestError as exc:
            log.warning("detour refused a report for %s: %s", q.broker_name, exc)

    for times in range(1 + retries):
        left_ns = limit_ns - (time.monotonic_ns() - start)
        if times and left_ns <= 0:
            raise SendError(topic, attempts, timed_out=True) from attempts[-1].error
        try:
            queue = await select(topic, last_broker)
        except DetourClientError as exc:
            raise _select_failed(topic, attempts, exc) from exc
        left_s = max(0.0, (limit_ns - (time.monotonic_ns() - start)) / 1e9)
        begin = time.monotonic_ns()
        try:
            async with asyncio.timeout(left_s):
                value = await deliver(queue, payload)
        except no_retry as exc:
            ms = _ms_since(begin)
            await safe_report(queue, ms, False)
            attempts.append(Attempt(queue, ms, exc))
            raise SendError(topic, attempts, timed_out=False) from exc
        except Exception as exc:  # noqa: BLE001 - any delivery failure is the broker's
            ms = _ms_since(begin)
            await safe_report(queue, ms, True)
            attempts.append(Attempt(queue, ms, exc))
            last_broker = queue.broker_name
            continue
        ms = _ms_since(begin)
        await safe_report(queue, ms, False)
        attempts.append(Attempt(queue, ms, None))
        return SendResult(queue, attempts, value)
    raise SendError(topic, attempts, timed_out=False) from attempts[-1].error
