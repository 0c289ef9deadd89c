"""A Server-Sent Events parser fed the stream's bytes: the sync and async readers share it.

Only what ``GET /fault-items/stream`` uses and the spec requires of a reader:
lines end with LF, CRLF or CR; ``event:`` and ``data:`` fields (several
``data:`` lines join with newlines), comments (``:``) and unknown fields
ignored, an empty line dispatches.

Bounded: a line, and an event's data, longer than ``max_bytes`` raises
``EventTooLarge`` (the reader drops the connection and reconnects). Without it
a server that never sends a newline grows the producer without end: a 300 MB
line once took a producer to 350 MB. The default is far above the largest
snapshot Detour sends with its default table cap (10,000 fault items make
about 1.5 MB).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

#: Default bound on one line and on one event's data (bytes).
MAX_EVENT_BYTES = 16 * 1024 * 1024

_EOL = re.compile(rb"\r\n|\r|\n")


class EventTooLarge(Exception):
    """A line, or an event's data, is longer than the parser's bound."""


@dataclass(frozen=True, slots=True)
class Event:
    kind: str
    data: dict[str, Any]


class SSEParser:
    def __init__(self, max_bytes: int = MAX_EVENT_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.max_bytes = max_bytes
        self._kind = ""
        self._data: list[str] = []
        self._data_bytes = 0
        self._buf = bytearray()
        # Where the next search for a line end starts: the buffer's start was searched
        # already, and searching a long line again for every chunk would be quadratic.
        self._searched = 0

    def feed_bytes(self, chunk: bytes) -> list[Event]:
        """Take the next bytes of the stream; return the events they complete.

        Raises EventTooLarge past the bound, ValueError when a dispatched event's
        data is not a JSON object.
        """
        buf = self._buf
        buf += chunk
        events: list[Event] = []
        start = 0
        while True:
            m = _EOL.search(buf, max(start, self._searched))
            if m is None or (m.group() == b"\r" and m.end() == len(buf)):
                # No line end yet, or a CR that may be the first half of a CRLF.
                self._searched = len(buf) - (1 if m is not None else 0)
                break
            if m.start() - start > self.max_bytes:
                raise EventTooLarge(f"a line of more than {self.max_bytes} bytes")
            event = self.feed(buf[start : m.start()].decode("utf-8", "replace"))
            start = m.end()
            if event is not None:
                events.append(event)
        del buf[:start]
        self._searched = max(0, self._searched - start)
        if len(buf) > self.max_bytes:
            raise EventTooLarge(f"a line of more than {self.max_bytes} bytes without its end")
        return events

    def feed(self, line: str) -> Event | None:
        """Take one line (without its end); return the event an empty line completes.

        Raises EventTooLarge past the bound, ValueError when a dispatched event's
        data is not a JSON object.
        """
        if not line:
            if not self._data:
                self._kind = ""
                return None
            kind, text = self._kind or "message", "\n".join(self._data)
            self._kind, self._data, self._data_bytes = "", [], 0
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError(f"event {kind!r} data is not a JSON object")
            return Event(kind, data)
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._kind = value
        elif name == "data":
            self._data_bytes += len(value) + 1
            if self._data_bytes > self.max_bytes:
                raise EventTooLarge(f"an event of more than {self.max_bytes} bytes of data")
            self._data.append(value)
        return None
