"""``GET /fault-items``' body: written out once, and kept while nothing in it can differ.

A table at its cap (10,000 brokers) took 105 ms of CPU per read through the response
models, so a few hundred reads (an open sidecar's, or an admin's) held the event loop for
tens of seconds and every select behind them waited. The body is now written out directly
(about half that), and kept: the items part is a function of the items and of which
windows have ended at ``now``, so it is reused while the store returns equal items
(the memory store returns the very same objects, compared by identity first) and
``now`` has not reached the next window end. Only ``now`` is written fresh. One entry
per store, replaced on a change: bounded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from detour.model import FaultItem

_NEVER = 2**63


@dataclass(slots=True)
class _Kept:
    items: list[FaultItem]
    #: The earliest window end after the time it was written: its flags hold until then.
    until: int
    since: int
    body: bytes


def _items_json(now: int, items: Sequence[FaultItem]) -> tuple[bytes, int]:
    """The ``items`` array as the model renders it, and when a flag in it next changes."""
    out = []
    until = _NEVER
    for i in sorted(items, key=lambda i: i.broker_name):
        available = i.is_available(now)
        if not available:
            until = min(until, i.available_at)
        why = i.why
        out.append(
            {
                "brokerName": i.broker_name,
                "currentLatencyMs": i.current_latency_ms,
                "availableAt": i.available_at,
                "available": available,
                "probation": i.probation,
                "reachable": i.reachable,
                "why": None
                if why is None or available
                else {
                    "reason": why.reason,
                    "since": why.since,
                    "latencyMs": why.latency_ms,
                    "by": why.by,
                },  # fmt: skip
            }
        )
    body = json.dumps(out, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return body.encode(), until


class TableAnswers:
    """The kept ``items`` bodies, one per store (keyed by the store object's id)."""

    def __init__(self) -> None:
        self._kept: dict[int, _Kept] = {}

    def body(self, store: object, now: int, items: list[FaultItem]) -> bytes:
        kept = self._kept.get(id(store))
        if kept is None or not (kept.since <= now < kept.until and kept.items == items):
            part, until = _items_json(now, items)
            kept = self._kept[id(store)] = _Kept(items, until, now, part)
        return b'{"now":%d,"items":%s}' % (now, kept.body)
