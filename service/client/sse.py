"""A Server-Sent Events parser fed line by line: the sync and async readers share it.

Only what ``GET /fault-items/stream`` uses and the spec requires of a reader:
``event:`` and ``data:`` fields (several ``data:`` lines join with newlines),
comments (``:``) and unknown fields ignored, an empty line dispatches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Event:
    kind: str
    data: dict[str, Any]


class SSEParser:
    def __init__(self) -> None:
        self._kind = ""
        self._data: list[str] = []

    def feed(self, line: str) -> Event | None:
        """Take one line (without its newline); return the event an empty line completes.

        Raises ValueError when a dispatched event's data is not a JSON object.
        """
        if not line:
            if not self._data:
                self._kind = ""
                return None
            kind, text = self._kind or "message", "\n".join(self._data)
            self._kind, self._data = "", []
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
            self._data.append(value)
        return None
