"""A table hash as Redis holds it, read raw by the tests, without the table's mark.

Each hash of the table (faults, routes, graves) carries the table's epoch in one field
(``service.store.codec.MARK``, lua/lib/item.lua ``table_epoch``), so that a hash Redis
dropped whole is told from an empty one. Tests that look at the entries read them here.
"""

from __future__ import annotations

from typing import Any

from service.store.codec import MARK


def fields(client: Any, key: str) -> dict[str, str]:
    """``HGETALL`` without the mark."""
    return {k: v for k, v in client.hgetall(key).items() if k != MARK}


def names(client: Any, key: str) -> set[str]:
    """``HKEYS`` without the mark."""
    return {k for k in client.hkeys(key) if k != MARK}


def size(client: Any, key: str) -> int:
    """``HLEN`` without the mark."""
    return int(client.hlen(key)) - int(bool(client.hexists(key, MARK)))
