"""The Lua scripts' positional replies, decoded into named fields in one place.

Each script's header (``store/lua/*.lua``) documents its reply; the classes here
mirror those headers, so the store reads ``reply.ends`` rather than ``reply[2]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: report.lua's statuses
APPLIED, STALE_CONFIG, TABLE_FULL, TABLE_LOST, ID_REUSED = 1, -1, -2, -3, -4


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


@dataclass(frozen=True, slots=True)
class ReportReply:
    """report.lua's reply: a status, Redis's clock, and one entry per report in each list."""

    status: int
    now_ms: int
    ends: list[int]
    versions: list[int]
    changes: list[int]
    #: status 1/-2: items evicted to make room; -1: the table's config stamp; -3: the
    #: table's epoch ("" = none); -4: the 1-based index of the report whose id was reused
    extra: Any
    quorums: list[int]
    durations: list[int]
    values: list[str]
    probes: list[int]
    duplicates: list[bool]
    #: the report's id may be one its scope forgot: not applied (service/store/ids.py)
    expired: list[bool]

    @classmethod
    def decode(cls, raw: Sequence[Any]) -> ReportReply:
        status, now, ends, versions, changes, extra, *rest = raw
        quorums, durations, values, probes, dups = rest if rest else ([], [], [], [], [])
        return cls(
            int(status),
            int(now),
            [int(x) for x in ends],
            [int(x) for x in versions],
            [int(x) for x in changes],
            extra,
            [int(x) for x in quorums],
            [int(x) for x in durations],
            [_text(x) for x in values],
            [int(x) for x in probes],
            [int(x) == 1 for x in dups],
            [int(x) == 2 for x in dups],
        )


@dataclass(frozen=True, slots=True)
class SnapshotReply:
    """snapshot.lua's reply: the whole table at one version, with its identity."""

    version: int
    config_stamp: int
    config: str
    now_ms: int
    faults: list[str]
    routes: list[str]
    epoch: str
    #: this writer's sequence high-water mark in the table
    high_water: int
    #: the last stamp the table gave
    hlc: int
    #: whether the table's history holds the lineage pair the replica sent
    known: bool
    #: the lineage token of ``version`` ("" = none)
    token: str

    @classmethod
    def decode(cls, raw: Sequence[Any]) -> SnapshotReply:
        version, config_stamp, config, now, faults, routes, epoch, high_water, hlc, known, token = (
            raw
        )
        return cls(
            int(version),
            int(config_stamp),
            _text(config),
            int(now),
            list(faults),
            list(routes),
            _text(epoch),
            int(high_water),
            int(hlc),
            int(known) == 1,
            _text(token),
        )


@dataclass(frozen=True, slots=True)
class PollReply:
    """poll.lua's reply: the table's version and identity, and Redis's clock."""

    version: int
    now_ms: int
    epoch: str
    high_water: int
    #: the last stamp the table gave
    hlc: int
    #: whether the table's history holds the lineage pair the replica sent
    known: bool

    @classmethod
    def decode(cls, raw: Sequence[Any]) -> PollReply:
        version, sec, usec, epoch, high_water, hlc, known = raw
        return cls(
            int(version or 0),
            int(sec) * 1000 + int(usec) // 1000,
            _text(epoch),
            int(high_water),
            int(hlc),
            int(known) == 1,
        )


@dataclass(frozen=True, slots=True)
class ReseedReply:
    """reseed.lua's reply: the epoch the table has now and what a merge wrote into it."""

    epoch: str
    version: int
    config: int
    routes: int
    items: int
    graves: int
    #: items the table had no room for
    refused: int

    @classmethod
    def decode(cls, raw: Sequence[Any]) -> ReseedReply:
        epoch, version, config, routes, items, graves, refused = raw
        return cls(
            _text(epoch),
            int(version),
            int(config),
            int(routes),
            int(items),
            int(graves),
            int(refused),
        )
