"""The store's Lua scripts as Redis runs them: ``lua/lib/item.lua`` (how an item, a route and
a stamp are read and written, in one place) before each script's own text."""

from __future__ import annotations

from functools import cache
from importlib import resources

#: Every script the store runs (service/store/lua/<name>.lua).
NAMES = ("report", "set_entry", "snapshot", "fault_items", "reach", "lease", "poll", "reseed")


#: lib/item.lua's ``push``: a channel argument starting with this is a sharded channel
SHARDED = "#"


def channel_arg(channel: str, *, sharded: bool) -> str:
    """The change channel as the scripts take it: ``sharded`` (a Redis Cluster) makes their
    pushes ``SPUBLISH`` (Redis 7), which only the nodes of the shard serving the slot carry;
    a classic ``PUBLISH`` in a cluster is broadcast to every node. (``#`` is outside the
    characters a prefix may have, so no channel name starts with it.)"""
    return SHARDED + channel if sharded else channel


def marker(replica: str) -> str:
    """``lua/marker.lua`` as one replica loads it: its own copy, its own SHA."""
    lua = resources.files("service.store") / "lua"
    return (lua / "marker.lua").read_text() + f"-- replica {replica}\n"


@cache
def source(name: str) -> str:
    """The text Redis loads for script ``name``: the library, then the script."""
    lua = resources.files("service.store") / "lua"
    return (lua / "lib" / "item.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()
