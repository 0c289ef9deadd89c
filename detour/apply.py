"""The one report rule: what reports do to a fault table, pure.

``apply_reports(table, reports, now_ms, rules)`` is the whole rule: the table cap and
its eviction, then each report in order (tiers, the isolation and latency quorums,
in-flight signals, backoff and jitter, probation, the staggered return). The memory
store, the Redis store's own copy while Redis is away (service/store/redis.py) and the
SDK's table copy (detour/client/local.py) call it; ``service/store/lua/report.lua``
applies the same rule inside Redis, where it must run to be atomic on Redis's clock,
and tests/test_report_rule.py drives random report sequences through both and compares
the tables.

Nothing here reads a clock or a random source: ``now_ms`` and the jitter rolls come in.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from detour import strategy
from detour.model import Config, FaultItem, Why
from detour.policy.backoff import backoff
from detour.policy.events import window_event
from detour.policy.pending import (
    HOLD,
    bounded_signals,
    live_signals,
    pending_tier,
    pending_vote,
    settle_pending,
)
from detour.policy.probation import probation_on
from detour.policy.recovery import ramp_end
from detour.policy.votes import (
    counts_toward_latency_quorum,
    counts_toward_quorum,
    latency_vote,
    quorum_vote,
)
from detour.strategy import WindowChange

#: Items dropped beyond what a full table needs, so the next new brokers find room at once
#: (the scan for ended windows is not repeated for each of them).
EVICT_SLACK = 16


@dataclass(frozen=True, slots=True)
class ReportIn:
    """One report as a producer made it; ``age_ms`` > 0 for a report replayed late.

    Built from a request in one place (service/api/reports.py ``report_in``) and by the
    SDK for its own table.
    """

    broker_name: str
    latency_ms: int
    isolation: bool = False
    #: how long before ``now`` the send completed (replayed reports): it happened at
    #: ``now - age_ms``
    age_ms: int = 0
    #: who reported (for the latency log and the quorums); "" when not given
    producer: str = ""
    #: where a failure came from: "broker", "local" or None (unstated)
    origin: str | None = None
    #: who the quorums count this report as: the token's identity when tokens are on (so
    #: one token cannot vote as many producers); None = ``producer``
    voter: str | None = None
    #: this replica's sequence number for the report (0 until the store gives it one): the
    #: identity its journal replay is applied once by
    seq: int = 0
    #: the producer's own identity for the report ("" = none): a retried batch or an SDK's
    #: replay carrying one already applied changes nothing
    report_id: str = ""
    #: an in-flight signal: the send has been outstanding ``latency_ms`` so far
    pending: bool = False
    #: whose ``report_id`` this is: the token's name when tokens are on, "" for an open
    #: deployment; no other scope can claim or evict it
    scope: str = ""
    #: when it happened on the table's clock, fixed once by the replica that accepted it
    #: (``dated``); None = ``now - age_ms`` wherever it is applied
    at_ms: int | None = None

    def at(self, now_ms: int) -> int:
        """When the report happened, as a store applying it at ``now_ms`` dates it: the
        one rule report.lua mirrors (``dated``). A report dated at acceptance keeps that
        date however late it is applied (a reply late, a journal replayed), so every copy
        opens the same window the producer was answered; never after ``now_ms``, so a
        replica whose clock ran ahead of the table's cannot open a window in its future."""
        if self.at_ms is None:
            return now_ms - self.age_ms
        return min(self.at_ms, now_ms)

    def dated(self, now_ms: int) -> ReportIn:
        """This report with its date fixed at ``now_ms`` (a replica's acceptance)."""
        return self if self.at_ms is not None else replace(self, at_ms=now_ms - self.age_ms)

    @property
    def voter_id(self) -> str:
        return self.producer if self.voter is None else self.voter

    @property
    def fingerprint(self) -> str:
        """What the report says, hashed: an id sent again with the same fingerprint is the
        same report; with another, a reused id. The age is left out (a replay carries the
        time since the send, which grows)."""
        said = (
            f"{self.broker_name}\0{self.latency_ms}\0{int(self.isolation)}\0{int(self.pending)}"
            f"\0{self.origin or ''}\0{self.producer}"
        )
        return hashlib.blake2b(said.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class Rules:
    """What a table's reports are applied under."""

    config: Config
    #: fault items the table may hold; a report naming a new broker beyond it first drops
    #: items whose window has ended, oldest end first, and is refused when none has
    cap: int = 10_000


@dataclass(frozen=True, slots=True)
class Effect:
    """What one report did to its broker's item."""

    #: the broker's item after the report (None: it has none, and the report made none)
    item: FaultItem | None
    #: the item was created or changed and must be stored
    written: bool
    #: the window length asked for (0: none, e.g. a failure short of its quorum)
    duration_ms: int
    #: index into latencyMax of the report's tier (an in-flight signal: the tier its quorum
    #: opens), None below every tier or with avoidance off
    tier: int | None
    change: WindowChange = WindowChange.NONE
    #: a report subject to a quorum: "suspected" (short of it) or "reached"
    quorum: str | None = None
    #: producers behind the report: the quorum's voters when it was reached, else 1
    reporters: int = 1
    #: a report on a broker on probation: "passed" (a success re-opened it to all) or
    #: "failed" (it opened a new window)
    probe: str | None = None
    #: (kind, reason) for the event log (policy.events.window_event), None for no event
    event: tuple[str, str] | None = None
    #: another replica must see the change (a window, a vote, a signal or probation): the
    #: Redis store pushes it
    visible: bool = False

    @property
    def available_at(self) -> int:
        """The window end after the report (0 for a broker with no item)."""
        return 0 if self.item is None else self.item.available_at

    @property
    def quorum_reached(self) -> bool:
        return self.quorum == "reached"

    @property
    def suspected(self) -> bool:
        return self.quorum == "suspected"


@dataclass(slots=True)
class Applied:
    """What a call of ``apply_reports`` did."""

    #: one per report, in order (empty when ``full``)
    effects: list[Effect] = field(default_factory=list)
    #: items dropped to make room, oldest window end first
    evicted: list[str] = field(default_factory=list)
    #: the table is full of open windows: no report was applied (``evicted`` were dropped)
    full: bool = False


#: (now, how many) -> up to that many brokers whose window has ended, oldest end first.
EndedIndex = Callable[[int, int], list[str]]


def scan_ended(table: Mapping[str, FaultItem]) -> EndedIndex:
    """``EndedIndex`` by a scan of ``table`` (the SDK's copy, a replica's own copy); a
    store with an index of window ends passes its own."""

    def oldest(now_ms: int, n: int) -> list[str]:
        ended = ((i.available_at, b) for b, i in table.items() if i.available_at <= now_ms)
        return [b for _, b in heapq.nsmallest(n, ended)]

    return oldest


def make_room(
    table: Mapping[str, FaultItem],
    brokers: Sequence[str],
    now_ms: int,
    cap: int,
    ended: EndedIndex | None = None,
) -> tuple[list[str], bool]:
    """(items to drop, whether the reports still do not fit) for reports naming
    ``brokers`` in a table capped at ``cap``.

    A report of a broker the table lacks needs a place. Past the cap, items whose window
    has ended go first, oldest end first, as many as needed and ``EVICT_SLACK`` more; if
    open windows alone fill the table, the reports do not fit and nothing is applied.
    """
    new = {b for b in brokers if b not in table}
    if not new or len(table) + len(new) <= cap:
        return [], False
    needed = len(table) + len(new) - cap
    candidates = (ended or scan_ended(table))(now_ms, needed + EVICT_SLACK)
    dropped = [b for b in candidates if b not in new or b in table]
    # a broker of these reports that is dropped needs its place back
    still_new = len(new) + sum(1 for b in dropped if b in brokers)
    return dropped, len(table) - len(dropped) + still_new > cap


def apply_reports(
    table: Mapping[str, FaultItem],
    reports: Sequence[ReportIn],
    now_ms: int,
    rules: Rules,
    jitter_rolls: Sequence[int] = (),
    ended: EndedIndex | None = None,
) -> Applied:
    """Apply ``reports`` in order to ``table`` (not modified: the caller writes each
    effect's item, and drops ``evicted``).

    ``jitter_rolls``: one draw in 0..JITTER_SCALE-1 per report (jitterPercent), 0 when
    missing. ``ended``: the table's index of ended windows (``scan_ended`` by default).
    With avoidance off no report changes anything and the cap does not apply.
    """
    config = rules.config
    out = Applied()
    if config.send_latency_fault_enable:
        out.evicted, out.full = make_room(
            table, [r.broker_name for r in reports], now_ms, rules.cap, ended
        )
        if out.full:
            return out
    gone = set(out.evicted)
    current: dict[str, FaultItem | None] = {}
    for i, r in enumerate(reports):
        b = r.broker_name
        old = current[b] if b in current else (None if b in gone else table.get(b))
        roll = jitter_rolls[i] if i < len(jitter_rolls) else 0
        effect = apply_one(old, r, now_ms, config, roll)
        if effect.written:
            current[b] = effect.item
        out.effects.append(effect)
    return out


def apply_one(
    old: FaultItem | None, report: ReportIn, now_ms: int, config: Config, jitter_roll: int = 0
) -> Effect:
    """What one report does to its broker's item ``old`` (report.lua applies the same).

    With the default config this is RocketMQ's ``updateFaultItem`` with the tier's
    duration, extend-only (``strategy.apply_report``): the quorums are 1, backoff, jitter,
    probation, the ramp and signals are off. With avoidance off nothing changes.
    """
    if not config.send_latency_fault_enable:
        return Effect(old, False, 0, None)
    at_ms = report.at(now_ms)
    if report.pending:
        return _signal(old, report, at_ms, now_ms, config)
    voter, isolation = report.voter_id, report.isolation
    tier = strategy.tier(config, report.latency_ms, isolation)
    duration = 0 if tier is None else config.not_available_duration[tier]
    suspects = old.suspects if old is not None else ()
    slow = old.slow if old is not None else ()
    reached = suspected = own_ended = False
    reporters, voters = 1, 0
    voted = counts_toward_quorum(config, isolation, report.origin)
    if voted:
        suspects, reached, voters = quorum_vote(suspects, voter, at_ms, now_ms, config)
    elif counts_toward_latency_quorum(config, isolation, duration, report.origin):
        voted = True
        slow, reached, voters = latency_vote(slow, voter, at_ms, at_ms + duration, now_ms, config)
    elif config.last_report_wins and any(v[0] == voter for v in slow):
        # lastReportWins (RocketMQ 4.x) overwrites the producer's own window too, as its
        # per-producer table would: a fast answer ends it
        slow = tuple(v for v in slow if v[0] != voter)
        own_ended = True
    if voted:
        reporters = voters if reached else 1
        suspected = not reached
        if suspected:
            duration = 0
    isolations = old.isolations if old is not None else 0
    if isolation and duration > 0:
        duration, isolations = backoff(config, duration, old, at_ms, jitter_roll)
    end = strategy.updated_available_at(
        None if old is None else old.available_at, at_ms, duration, config.last_report_wins
    )
    old_probation = old is not None and old.probation and probation_on(config)
    probing = old_probation and old is not None and at_ms >= old.available_at
    probation, probe = old_probation, None
    if not probation_on(config):
        probation = False
    elif duration > 0:
        # earlyRecovery alone: a failed probe re-isolates, the window's end returns the broker
        probation = config.probe_on_expiry
        probe = "failed" if probing else None
    elif probing and not isolation:
        probation, probe = False, "passed"
    if config.ramp_ms and duration == 0 and probe is None:
        end = ramp_end(old, end, at_ms)
    signals = old.pending if old is not None else ()
    if signals:
        live = any(p == voter and s > 0 for p, _, s in signals)
        signals, end = settle_pending(signals, voter, isolation, end, at_ms, now_ms, config)
        own_ended = own_ended or live
    change = strategy.window_change(None if old is None else old.available_at, end, now_ms)
    event = window_event(change, isolation, reached, probe)
    item = FaultItem(
        report.broker_name,
        report.latency_ms,
        end,
        isolations,
        suspects,
        probation,
        None if old is None else old.reachable,
        slow,
        signals,
        why_after(old, event, report, at_ms, end, now_ms),
    )
    quorum = "reached" if reached else "suspected" if suspected else None
    had_probation = old is not None and old.probation
    return Effect(
        item,
        True,
        duration,
        tier,
        change,
        quorum,
        reporters,
        probe,
        event,
        change is not WindowChange.NONE
        or quorum is not None
        or own_ended
        or probation != had_probation,
    )


def _signal(
    old: FaultItem | None, report: ReportIn, at_ms: int, now_ms: int, config: Config
) -> Effect:
    """An in-flight signal: a send to the broker outstanding for ``latency_ms`` at ``at_ms``.

    With ``pendingQuorum`` 0, or no tier with a window, nothing changes (no item is
    created). Otherwise the signal is recorded (``pending_vote``); when distinct producers
    with a live signal reach ``pendingQuorum`` the window of ``pending_tier`` opens for
    everyone, extend-only (whatever ``lastReportWins`` says: a signal is no answer that
    could end a window), held by the signals until their sends complete
    (``settle_pending``). ``currentLatencyMs`` stays: no send has completed.
    """
    t = pending_tier(config, report.latency_ms) if config.pending_quorum else None
    duration = 0 if t is None else config.not_available_duration[t]
    if duration == 0:
        return Effect(old, False, 0, t)
    # A broker's first report being a signal creates an item whose window never opened
    # (end 0), not one ending at the signal: a replica's clock, a little behind the
    # store's by design (it errs toward avoiding), would see that end as a window.
    base = old if old is not None else FaultItem(report.broker_name, 0, 0)
    voter = report.voter_id
    signals, accepted = pending_vote(
        base.pending, voter, at_ms - report.latency_ms, at_ms, now_ms, config
    )
    if not accepted:
        return Effect(old, False, 0, t)
    voters = live_signals(signals, now_ms, config)
    if len(voters) < config.pending_quorum:
        why = why_after(old, None, report, at_ms, base.available_at, now_ms)
        item = replace(base, pending=signals, why=why)
        return Effect(item, True, 0, t, quorum="suspected", visible=True)
    end = base.available_at
    if at_ms + duration > end:
        # the signals hold the window (``settle_pending`` may end it early); the signals
        # stay: each completed send withdraws its own
        end = at_ms + duration
        signals = bounded_signals(signals, HOLD, (HOLD, end, 0), now_ms, config)
    change = strategy.window_change(None if old is None else old.available_at, end, now_ms)
    event = window_event(change, False, True, None, pending=True)
    why = why_after(old, event, report, at_ms, end, now_ms)
    item = replace(base, available_at=end, pending=signals, why=why)
    return Effect(item, True, duration, t, change, "reached", len(voters), None, event, True)


def why_after(
    old: FaultItem | None,
    event: tuple[str, str] | None,
    report: ReportIn,
    at_ms: int,
    end_ms: int,
    now_ms: int,
) -> Why | None:
    """Why the window is open after ``report``: the report itself when it opened or moved
    the window end (its event's reason; a quorum of slow answers is a ``latency`` window,
    ``quorum`` is one of failures), what it was before when the window is still open, none
    once it is over. report.lua keeps the same."""
    if event is not None and event[0] in ("opened", "extended", "quorum"):
        reason = event[1]
        if reason == "quorum" and not report.isolation:
            reason = "latency"
        return Why(reason, at_ms, report.latency_ms, report.voter_id)
    if end_ms > now_ms and old is not None:
        return old.why
    return None
