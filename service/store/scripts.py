"""The store's Lua scripts as Redis runs them: ``lua/lib/item.lua`` (how an item, a route and
a stamp are read and written, in one place) before each script's own text."""

from __future__ import annotations

from functools import cache
from importlib import resources

#: Every script the store runs (service/store/lua/<name>.lua).
NAMES = ("report", "set_entry", "snapshot", "fault_items", "reach", "lease", "poll", "reseed")


def marker(replica: str) -> str:
    """``lua/marker.lua`` as one replica loads it: its own copy, its own SHA."""
    lua = resources.files("service.store") / "lua"
    return (lua / "marker.lua").read_text() + f"-- replica {replica}\n"


@cache
def source(name: str) -> str:
    """The text Redis loads for script ``name``: the library, then the script."""
    lua = resources.files("service.store") / "lua"
    return (lua / "lib" / "item.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()
