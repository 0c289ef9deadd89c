"""Push streams held to their bounds: how many are open (per token, per process), and a
response that drops a client who stops reading (docs/security.md, "Streams, scrapes and
names")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from service.errors import error_body
from service.metrics import STREAMS_DROPPED, STREAMS_REFUSED

log = logging.getLogger("detour")


@dataclass(slots=True)
class StreamGate:
    """How many push streams are open, per token and in all; refuses past the caps.

    Each open stream holds a socket, a subscription and a backlog, so a token (or a
    flood of connects) could otherwise hold as many as it likes. With no tokens, only
    the process cap applies (every caller is the same principal).
    """

    max_streams: int = 512
    max_per_token: int = 128
    #: Seconds a send may wait on a client that does not read before it is dropped.
    send_timeout_s: float = 10.0
    #: Changes a slow reader may fall behind by before it gets a fresh snapshot instead.
    backlog: int = 1024
    open: int = 0
    by_token: dict[str, int] = field(default_factory=dict)
    #: Streams dropped because their client stopped reading.
    dropped: int = 0
    _logged: int = 0
    _log_at: float = 0.0

    def enter(self, token: str | None) -> Response | None:
        """Count a new stream in, or the refusal to answer with instead."""
        if self.open >= self.max_streams:
            STREAMS_REFUSED.labels("process").inc()
            return _refusal(
                503,
                "SYSTEM_BUSY",
                f"this replica serves {self.max_streams} push streams already: retry shortly "
                "(another replica), or decide from the last table",
            )
        if token is not None:
            held = self.by_token.get(token, 0)
            if held >= self.max_per_token:
                STREAMS_REFUSED.labels("token").inc()
                return _refusal(
                    429,
                    "TOO_MANY_STREAMS",
                    f"this token holds {held} push streams open already "
                    f"(at most {self.max_per_token} per replica): close one first",
                )
            self.by_token[token] = held + 1
        self.open += 1
        return None

    def note_drop(self) -> None:
        """Count a stream dropped for not reading; say so in the log at most once a second
        (a flood of such clients must not become a flood of log lines)."""
        self.dropped += 1
        STREAMS_DROPPED.inc()
        now = time.monotonic()
        if now >= self._log_at:
            log.warning(
                "push streams dropped: %d client(s) read nothing for %.1f s",
                self.dropped - self._logged,
                self.send_timeout_s,
            )
            self._logged, self._log_at = self.dropped, now + 1.0

    def leave(self, token: str | None) -> None:
        self.open -= 1
        if token is not None:
            left = self.by_token[token] - 1
            if left:
                self.by_token[token] = left
            else:
                del self.by_token[token]


def _refusal(status: int, code: str, message: str) -> Response:
    return JSONResponse(error_body(code, message), status_code=status, headers={"Retry-After": "1"})


class _Stalled(Exception):
    """A send waited longer than the gate's send timeout: the client is not reading."""


class PushResponse(StreamingResponse):
    """An event stream whose client must keep reading: a send that cannot go out within
    ``send_timeout_s`` ends the stream and closes the connection. The socket's kernel
    buffer is fixed (``stream_send_buffer_bytes``) and the transport's at 16 KiB above
    it (both set by the server protocol, service/edge/shedding.py), and a snapshot goes out in
    16 KiB slices: so a client that
    stops reading holds at most those buffers, one slice or event and the backlog of
    changes, for at most ``send_timeout_s``."""

    def __init__(
        self, content: AsyncIterator[bytes | memoryview], gate: StreamGate, token: str | None
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._gate = gate
        self._token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self._gate.send_timeout_s

        async def bounded(message: Message) -> None:
            try:
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                raise _Stalled from None

        try:
            await super().__call__(scope, receive, bounded)
        except _Stalled:
            # Returning without finishing the response makes the server close the
            # connection (and say so in its log): the buffer goes with it.
            self._gate.note_drop()
        finally:
            self._gate.leave(self._token)
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()  # unsubscribes at once, not whenever it is collected
