"""Keyed (ordered) selects: a sharding key's home queue, and where it goes when its broker
is avoided."""

from __future__ import annotations

import zlib
from collections.abc import Collection

from detour.model import Queue, Route


def shard_index(key: str, n: int) -> int:
    """The queue index for a sharding key: CRC-32 of its UTF-8 bytes modulo ``n``.

    CRC-32 is in every language's standard library (Java ``java.util.zip.CRC32``,
    Go ``hash/crc32``, Python ``zlib``), so producers can reproduce the mapping, and
    unlike Java's ``String.hashCode`` it is defined on bytes, not UTF-16 units.
    """
    return zlib.crc32(key.encode()) % n


def ordered_pick(
    route: Route, key: str, avoided: Collection[str], fallback: str
) -> tuple[Queue, str]:
    """The key's queue, and how it was chosen: ``"home"``, ``"wait"`` or ``"remap"``.

    ``home``: the key's own queue, its broker not avoided. ``wait``: the key's queue
    although its broker is avoided (order is kept; the send may have to wait).
    ``remap``: the first queue after it, in route order and cyclically, whose broker
    is not avoided: stable for as long as the set of avoided brokers is, so the
    key's messages stay in order on the new queue. With every broker avoided a
    remap has nowhere to go and answers ``wait``.
    """
    queues = route.queues
    n = len(queues)
    if n == 0:
        raise ValueError("route has no queues")
    home = shard_index(key, n)
    q = queues[home]
    if q.broker_name not in avoided:
        return q, "home"
    if fallback == "remap":
        for step in range(1, n):
            cand = queues[(home + step) % n]
            if cand.broker_name not in avoided:
                return cand, "remap"
    return q, "wait"
