"""What a replica sends to Redis in a merge, and how (reseed.lua's calls).

After a discontinuity (service/store/redis.py ``RedisStore._loss``) a replica merges what
it holds into the table, by detour.merge's rules: only what the table lacks or holds an
older copy of goes, so a merge nobody needed sends nothing beyond the snapshot it compares
with. reseed.lua applies the same rules again, atomically per entry, against whatever the
table holds by then.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from detour.merge import adds_to, beats_grave
from detour.view import Snapshot, TableView
from service.store import codec

#: Items per reseed.lua call: a merge of 10,000 windows goes back without holding Redis long.
CHUNK = 200


@dataclass(slots=True)
class Candidates:
    """What this replica holds that the table, as one snapshot showed it, lacks."""

    #: (config JSON, its stamp), or None
    config: tuple[str, int] | None = None
    #: (topic, stored route "stamp|json")
    routes: list[tuple[str, str]] = field(default_factory=list)
    #: ("r#topic" | "f#broker", the delete's stamp)
    graves: list[tuple[str, int]] = field(default_factory=list)
    #: (broker, stored item), open windows first (the table gives them room first)
    items: list[tuple[str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.config or self.routes or self.graves or self.items)


def candidates(view: TableView, snap: Snapshot, now_ms: int) -> Candidates:
    """Compare the view with ``snap`` by the merge rules (detour.merge)."""
    out = Candidates()
    # (a table without a config has stamp -1: a config written before stamps goes back too)
    if view.config_stamp > snap.config_stamp and view.config_stamp >= 0:
        out.config = (codec.encode_config(view.config), view.config_stamp)
    for topic, route in view.routes.items():
        stamp = view.route_stamps.get(topic, 0)
        if topic not in snap.routes or stamp > snap.route_stamps.get(topic, 0):
            out.routes.append((topic, codec.stamped_route(route, stamp)))
    for topic, stamp in view.route_graves.items(now_ms):
        if topic in snap.routes and not beats_grave(snap.route_stamps.get(topic, 0), stamp):
            out.graves.append((f"r#{topic}", stamp))
    for broker, stamp in view.fault_graves.items(now_ms):
        theirs = snap.faults.get(broker)
        if theirs is not None and not beats_grave(theirs.stamp, stamp):
            out.graves.append((f"f#{broker}", stamp))
    mine = [
        (item.available_at <= now_ms, -item.available_at, broker, item)
        for broker, item in view.faults.items()
        if broker not in view.local and adds_to(snap.faults.get(broker), item, codec.encode_fault)
    ]
    out.items = [(b, codec.encode_fault(i)) for _, _, b, i in sorted(mine)]
    return out


def calls(c: Candidates, head: Sequence[Any], cap: int, announce: bool) -> Iterator[list[Any]]:
    """reseed.lua's ARGV per call: ``head`` (channel, fresh epoch, event cap, the merging
    replica's id), then the config, routes and graves in the first call, ``CHUNK`` items in
    each; the last one announces the merge when ``announce``."""
    items = [c.items[i : i + CHUNK] for i in range(0, len(c.items), CHUNK)] or [[]]
    for n, chunk in enumerate(items):
        last = n == len(items) - 1
        args: list[Any] = [*head, int(announce and last), cap]
        if n == 0:
            config, stamp = c.config or ("", 0)
            args += [config, stamp, len(c.routes)]
            for topic, value in c.routes:
                args += [topic, value]
            args.append(len(c.graves))
            for member, grave in c.graves:
                args += [member, grave]
        else:
            args += ["", 0, 0, 0]
        for broker, value in chunk:
            args += [broker, value]
        yield args
