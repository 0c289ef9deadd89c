"""Report ids a replica answered itself: each producer's retry is answered as its first.

A ``reportId`` is the producer's identity for one report (the SDK's replay after a lost
reply, a retried batch). Ids live in scopes: the token's name when tokens are on, one
open scope otherwise, so no other token can claim an id or push it out. A scope keeps an
id for ``window_ms`` and at most ``cap`` ids (past it, its own oldest go: only the scope's
own traffic can evict them). With the id comes what the report said (its fingerprint) and
the answer it got: an id sent again with the same content is answered as it was the first
time (``duplicate``); with other content it is refused (``ReportIdReused``), as an
idempotency key reused with other parameters is.

A memory this size cannot hold every id for ever, so it says what it may have forgotten:
its scope's horizon, the later of the window's start and the newest first sighting of an
id the cap pushed out (plus ``REPORT_ID_MARGIN_MS``). A report whose id is not remembered
and that is dated at or before the horizon may be the replay of a forgotten one: it is
answered ``expired`` and not applied. A replay after another tenant's 100,000 reports (or
the SDK's, after the window) was applied a second time; now it never is, and the
producer is told (the SDK counts it).

The memory store keeps every id here; the Redis store keeps the ids of reports it kept
local (policy.quiet) here and the others in Redis (report.lua, with the same bounds).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from detour.apply import ReportIn
from service.errors import ReportIdReused
from service.store.base import (
    REPORT_ID_CAP,
    REPORT_ID_MARGIN_MS,
    REPORT_ID_WINDOW_MS,
    ReportOutcome,
)


@dataclass(slots=True)
class Sorted:
    """A call's reports sorted by their ids (``ReportIds.sort``): the answers already known
    (repeats of an earlier call), the reports to apply, and the repeats within the call
    (index, index of its first)."""

    out: list[ReportOutcome | None]
    fresh: list[tuple[int, ReportIn]] = field(default_factory=list)
    repeats: list[tuple[int, int]] = field(default_factory=list)
    #: how many of ``out`` are answered ``expired`` (not duplicates)
    expired: int = 0

    @property
    def duplicates(self) -> int:
        return sum(o is not None for o in self.out) - self.expired + len(self.repeats)


def expired_answer(r: ReportIn, now_ms: int, window_end: int) -> ReportOutcome:
    """The answer to a report whose id its scope may have forgotten: nothing applied; the
    broker's window as it is."""
    return ReportOutcome(r.broker_name, r.latency_ms, 0, window_end, now_ms, r.isolation,
                         expired=True)  # fmt: skip


class ReportIds:
    """Scoped, bounded memory of report ids with their fingerprint and first answer."""

    def __init__(self, window_ms: int = REPORT_ID_WINDOW_MS, cap: int | None = None) -> None:
        self._window_ms = window_ms
        self._cap = REPORT_ID_CAP if cap is None else cap
        #: scope -> report id -> (first seen ms, fingerprint, first answer), oldest first
        self._scopes: dict[str, OrderedDict[str, tuple[int, str, ReportOutcome]]] = {}
        #: scope -> the newest first sighting of an id the cap pushed out (one per scope:
        #: scopes are tokens, bounded by the tokens file)
        self._forgotten: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._scopes.values())

    def scopes(self) -> int:
        return len(self._scopes)

    def check(self, reports: list[ReportIn], now_ms: int) -> None:
        """Raises ReportIdReused, naming the report's index, when one carries an id seen
        with other content (in the memory or earlier in ``reports``): checked for the whole
        call before anything is applied, so a refused call changes nothing."""
        seen: dict[tuple[str, str], str] = {}
        for i, r in enumerate(reports):
            if not r.report_id:
                continue
            key = (r.scope, r.report_id)
            fp = r.fingerprint
            known = self._get(r, now_ms)
            first = known[1] if known is not None else seen.get(key)
            if first is not None and first != fp:
                raise ReportIdReused(r.report_id, i)
            seen.setdefault(key, fp)

    def horizon(self, scope: str, now_ms: int) -> int:
        """Reports of ``scope`` dated at or before this may carry an id it has forgotten.

        The margin after the newest id the cap pushed out is at most half the time since
        that id was first seen: a scope whose memory spans only seconds (ids pushed out
        fast) still has its fresh reports, dated now, taken as new, never all expired."""
        by_time = now_ms - self._window_ms + REPORT_ID_MARGIN_MS
        pushed = self._forgotten.get(scope)
        if pushed is None:
            return by_time
        return max(by_time, pushed + min(REPORT_ID_MARGIN_MS, (now_ms - pushed) // 2))

    def expired(self, r: ReportIn, now_ms: int) -> bool:
        """``r`` carries an id this memory does not hold and may have forgotten (call after
        ``first`` found none): answered ``expired_answer``, not applied."""
        return bool(r.report_id) and r.at(now_ms) <= self.horizon(r.scope, now_ms)

    def sort(
        self, reports: Sequence[ReportIn], now_ms: int, window_end: Callable[[str], int]
    ) -> Sorted:
        """The one rule for a call's ids, wherever the call is applied (the memory table,
        a Redis replica's journal): ``check`` (raises ReportIdReused, nothing applied), then
        each report is answered as its id's first time, or as expired (``window_end``: a
        broker's window end now), or is a repeat of an earlier one of the call, or is
        fresh. Apply the fresh ones, then ``settle``."""
        batch = list(reports)
        self.check(batch, now_ms)
        done = Sorted([None] * len(batch))
        first_in_call: dict[tuple[str, str], int] = {}
        for i, r in enumerate(batch):
            prior = self.first(r, now_ms)
            if prior is not None:
                done.out[i] = prior
            elif self.expired(r, now_ms):
                done.out[i] = expired_answer(r, now_ms, window_end(r.broker_name))
                done.expired += 1
            elif r.report_id and (r.scope, r.report_id) in first_in_call:
                done.repeats.append((i, first_in_call[(r.scope, r.report_id)]))
            else:
                if r.report_id:
                    first_in_call[(r.scope, r.report_id)] = i
                done.fresh.append((i, r))
        return done

    def settle(
        self, done: Sorted, answers: Sequence[ReportOutcome], now_ms: int
    ) -> list[ReportOutcome]:
        """Remember each fresh report's ``answers`` (in ``done.fresh``'s order) under its id,
        answer the repeats within the call as their first, and return every answer in the
        call's order."""
        out = done.out
        for (i, r), answer in zip(done.fresh, answers, strict=True):
            out[i] = answer
            self.remember(r, answer, now_ms)
        for i, first in done.repeats:
            answered = out[first]
            assert answered is not None
            out[i] = replace(answered, duplicate=True)
        return [o for o in out if o is not None]

    def first(self, r: ReportIn, now_ms: int) -> ReportOutcome | None:
        """The answer ``r``'s id got the first time, marked ``duplicate``; None when the id is
        new (or ``r`` has none). ``check`` ran before: the content is the same."""
        known = self._get(r, now_ms) if r.report_id else None
        if known is None:
            return None
        return replace(known[2], duplicate=True)

    def remember(self, r: ReportIn, answer: ReportOutcome, now_ms: int) -> None:
        if not r.report_id:
            return
        ids = self._scopes.setdefault(r.scope, OrderedDict())
        ids[r.report_id] = (now_ms, r.fingerprint, answer)
        while len(ids) > self._cap:
            _, (first_seen, _, _) = ids.popitem(last=False)
            if first_seen > self._forgotten.get(r.scope, 0):
                self._forgotten[r.scope] = first_seen

    def _get(self, r: ReportIn, now_ms: int) -> tuple[int, str, ReportOutcome] | None:
        ids = self._scopes.get(r.scope)
        if ids is None:
            return None
        self._expire(r.scope, ids, now_ms)
        return ids.get(r.report_id)

    def _expire(
        self, scope: str, ids: OrderedDict[str, tuple[int, str, ReportOutcome]], now_ms: int
    ) -> None:
        horizon = now_ms - self._window_ms
        for _ in range(64):  # bounded per call; the cap bounds the rest
            if not ids:
                del self._scopes[scope]
                return
            first_seen = next(iter(ids.values()))[0]
            if first_seen > horizon:
                return
            ids.popitem(last=False)
