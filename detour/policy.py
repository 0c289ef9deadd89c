"""Avoidance policy beyond RocketMQ, pure: keyed (ordered) selects, panic and avoidance
limits, dry-run enforcement, power-of-two-choices on peak-EWMA latency, the isolation
quorum and repeat-offender backoff.

Like ``detour.strategy`` this module does no I/O and reads no clock and no random
source: ``now`` and every random draw come in as arguments, so the stores, the API
and the tests share one implementation and tests are deterministic. With a default
``Config`` every function here reduces to RocketMQ's behaviour (``strategy``);
docs/policy.md explains each knob, the peer it comes from and how Detour differs.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from detour import strategy
from detour.model import Config, FaultItem, Queue, Route

#: Suspects kept per broker: enough for any quorum, bounded so one item stays small.
MAX_SUSPECTS = 128
#: Time constant (ms) of the peak-EWMA latency, Finagle's default decay window.
EWMA_DECAY_MS = 10_000.0
#: Time constant (ms) by which a score fades while its broker gets no reports: without
#: it a broker that had one slow answer would never be chosen again, so never measured.
IDLE_DECAY_MS = 1_000.0
#: The jitter roll's range: report.lua receives integers 0..JITTER_SCALE-1 (small enough
#: that Lua's double arithmetic floors the jitter exactly as Python's integers do).
JITTER_SCALE = 10_000
#: The isolation count stops rising here (the window is capped long before).
MAX_ISOLATIONS = 1000


# ---------------------------------------------------------------- keyed (ordered) selects


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


# ---------------------------------------------------------------- which windows a select obeys


class Avoidance(NamedTuple):
    """Which of a route's brokers one select avoids, and why the others are not.

    A NamedTuple, as ``Choice`` and ``strategy.Selection``: immutable and cheap to build
    on every select (docs/BENCHMARKS.md, "One select everywhere").
    """

    #: brokers with an open window, for everyone or for this producer, in route order
    detected: tuple[str, ...]
    #: the brokers this select avoids
    enforced: frozenset[str]
    #: detected but served: panic, a dry run, or past maxAvoidedPercent (best first)
    unenforced: tuple[str, ...]
    panic: bool = False
    dry_run: bool = False


NOTHING_AVOIDED = Avoidance((), frozenset(), ())


def producer_windows(
    faults: Mapping[str, FaultItem], producer: str | None, config: Config
) -> dict[str, int]:
    """Window ends (ms) that apply to ``producer`` alone: its failures short of the
    isolation quorum and its slow answers short of the latency quorum.

    A lone reporter may have a broken link, a cold connection or a GC pause of its own;
    it keeps away from the broker as RocketMQ's per-producer table would, without
    deciding for every producer.
    """
    if producer is None or (config.isolation_quorum <= 1 and config.latency_quorum <= 1):
        return {}
    duration = strategy.report_duration(config, 0, True)
    out: dict[str, int] = {}
    for broker, item in faults.items():
        for who, at in item.suspects:
            if who == producer:
                out[broker] = max(out.get(broker, 0), at + duration)
        for who, _, end in item.slow:
            if who == producer:
                out[broker] = max(out.get(broker, 0), end)
    return out


def avoidance(
    route: Route,
    faults: Mapping[str, FaultItem],
    now_ms: int,
    config: Config,
    enforce_roll: float,
    local: Mapping[str, int] | None = None,
    ramp_roll: float = 0.0,
) -> Avoidance:
    """Decide which open windows this select obeys.

    ``enforce_roll`` is a uniform draw in [0, 1): the select enforces windows when
    ``roll * 100 < enforcementPercent``. ``local`` holds windows of this producer
    alone (``producer_windows``). ``ramp_roll``, a uniform draw in [0, 1), decides which
    brokers still ramping up after their window this select skips (``ramp_skips``; they
    count as detected, like an open window). Order: the dry run first (an unenforced
    select obeys nothing), then maxAvoidedPercent (the worst brokers stay avoided, the
    least bad by pickOneAtLeast's ranking are served), then the panic threshold on
    what remains available.
    """
    brokers = route.by_broker
    # A plain loop with on_probation inlined: this runs on every select. Detected: an
    # open window, one that has ended on a broker still on probation, or this
    # producer's own window.
    probation = probation_on(config)
    ramp = config.ramp_ms
    found: list[str] = []
    for b in brokers:
        item = faults.get(b)
        if (
            item is not None
            and (
                now_ms < item.available_at
                or (probation and item.probation)
                or (ramp and ramp_skips(item, now_ms, config, ramp_roll))
            )
        ) or (local and now_ms < local.get(b, 0)):
            found.append(b)
    if not found:
        return NOTHING_AVOIDED
    detected = tuple(found)
    local = local or {}
    if enforce_roll * 100 >= config.enforcement_percent:
        return Avoidance(detected, frozenset(), detected, dry_run=True)
    enforced = list(detected)
    released: list[str] = []
    cap = len(brokers) * config.max_avoided_percent // 100
    if len(enforced) > cap:
        ranked = strategy.rank_brokers(enforced, _with_local(faults, local), now_ms)
        released = ranked[: len(enforced) - cap]
        enforced = ranked[len(enforced) - cap :]
    available = len(brokers) - len(enforced)
    if config.panic_threshold_percent and available * 100 < (
        config.panic_threshold_percent * len(brokers)
    ):
        return Avoidance(detected, frozenset(), detected, panic=True)
    return Avoidance(detected, frozenset(enforced), tuple(released))


def _with_local(faults: Mapping[str, FaultItem], local: Mapping[str, int]) -> dict[str, FaultItem]:
    """The table as this producer sees it: its own windows count as open ones."""
    if not local:
        return dict(faults)
    out = dict(faults)
    for broker, end in local.items():
        item = out.get(broker)
        if item is None:
            out[broker] = FaultItem(broker, 0, end)
        elif end > item.available_at:
            out[broker] = FaultItem(broker, item.current_latency_ms, end)
    return out


def on_probation(item: FaultItem, now_ms: int, config: Config) -> bool:
    """The broker's window has ended but it waits for a probe to succeed (probeOnExpiry,
    or earlyRecovery's early probation)."""
    return probation_on(config) and item.probation and now_ms >= item.available_at


def probe_free(
    item: FaultItem, now_ms: int, config: Config, handed: tuple[int, int] | None
) -> bool:
    """Whether a select may be the probe for this broker now.

    ``handed`` is (window end, when) of the last probe this replica gave for the
    broker: one probe per window end, another only after ``probeTimeoutMs`` went by
    without a report deciding it (the probe's send was lost or never reported).
    """
    if not on_probation(item, now_ms, config):
        return False
    if handed is None or handed[0] != item.available_at:
        return True
    return now_ms - handed[1] >= config.probe_timeout_ms


# ---------------------------------------------------------------- power of two choices


def peak_ewma(old: float | None, old_at_ms: int, sample_ms: float, now_ms: int) -> float:
    """Finagle's peak EWMA: jump up to a slower sample at once, decay toward faster ones.

    A broker that just got slow is penalised immediately; one that recovers earns
    its way back over ``EWMA_DECAY_MS``.
    """
    if old is None or sample_ms >= old:
        return float(sample_ms)
    w = math.exp(-max(0, now_ms - old_at_ms) / EWMA_DECAY_MS)
    return old * w + sample_ms * (1 - w)


def idle_score(value: float, at_ms: int, now_ms: int) -> float:
    """A peak-EWMA score as seen ``now``: it fades toward 0 while no report refreshes it,
    so a broker that stopped being chosen is tried (and measured) again."""
    return value * math.exp(-max(0, now_ms - at_ms) / IDLE_DECAY_MS)


def p2c_pick(
    route: Route,
    avoided: Collection[str],
    last_broker: str | None,
    scores: Mapping[str, float],
    r1: int,
    r2: int,
) -> Queue | None:
    """Two distinct queues at random (``r1``, ``r2`` are the draws) among the available
    ones, the one whose broker has the lower latency score wins (ties: the first).

    Queues on ``last_broker`` are left out while another broker is available, as in
    the round-robin walk. A broker without a score counts as 0 (new brokers get
    traffic and so a score). None when every broker is avoided.
    """
    usable = [q for q in route.queues if q.broker_name not in avoided]
    preferred = [q for q in usable if q.broker_name != last_broker] or usable
    n = len(preferred)
    if n == 0:
        return None
    i = r1 % n
    a = preferred[i]
    if n == 1:
        return a
    j = r2 % (n - 1)
    b = preferred[j + 1 if j >= i else j]
    return b if scores.get(b.broker_name, 0.0) < scores.get(a.broker_name, 0.0) else a


# ---------------------------------------------------------------- one select, every knob


class Choice(NamedTuple):
    """One select's outcome under the whole policy."""

    selection: strategy.Selection
    avoidance: Avoidance
    #: None for an unkeyed select; "home", "wait" or "remap" for a keyed one
    ordered: str | None = None
    #: the broker this select probes (probeOnExpiry), None when it is no probe
    probe: str | None = None


@dataclass(frozen=True, slots=True)
class Draws:
    """The random values one select may use, drawn by the caller."""

    enforce: float = 0.0
    p2c_first: int = 0
    p2c_second: int = 1
    #: the staggered return's roll, uniform in [0, 1) (rampMs): 0 never skips a broker
    ramp: float = 0.0


def choose(
    route: Route,
    counter: int,
    faults: Mapping[str, FaultItem],
    now_ms: int,
    last_broker: str | None,
    config: Config,
    draws: Draws = Draws(),
    producer: str | None = None,
    sharding_key: str | None = None,
    scores: Mapping[str, float] | None = None,
    probes: Collection[str] = (),
) -> Choice:
    """One select with the whole policy; with a default config and no key or producer
    it is exactly ``strategy.select``.

    ``probes`` are the brokers on probation this select may probe (``probe_free``);
    a probe goes first: the select returns one of them (the first by name that is not
    ``last_broker``; for a keyed select only the key's own broker).

    Raises ValueError when the route has no queue.
    """
    if not config.send_latency_fault_enable:
        if sharding_key is not None:
            q, _ = ordered_pick(route, sharding_key, (), config.ordered_fallback)
            sel = strategy.Selection(q, strategy.Decision.ROUND_ROBIN, (), counter)
            return Choice(sel, Avoidance((), frozenset(), ()), "home")
        sel = strategy.select(route, counter, faults, now_ms, last_broker, False)
        return Choice(sel, Avoidance((), frozenset(), ()))
    local = producer_windows(faults, producer, config)
    av = avoidance(route, faults, now_ms, config, draws.enforce, local, draws.ramp)
    if (
        (not av.detected or (not local and not av.unenforced))
        and not probes
        and sharding_key is None
        and config.selection != "p2c-ewma"
        and not probation_on(config)
        and not config.ramp_ms
    ):
        # The common case, checked first because it runs on almost every select: nothing
        # is avoided, or the table's windows alone decide; exactly RocketMQ's walk.
        return Choice(strategy.select(route, counter, faults, now_ms, last_broker, True), av)
    # the avoided brokers in route order, for the answers built here (not the walk's)
    order = [b for b in av.detected if b in av.enforced]
    if probes:
        probe = _probe(route, counter, av, probes, last_broker, sharding_key, order)
        if probe is not None:
            return probe
    if sharding_key is not None:
        q, how = ordered_pick(route, sharding_key, av.enforced, config.ordered_fallback)
        decision = (
            strategy.Decision.PICK_ONE_AT_LEAST
            if q.broker_name in av.enforced
            else strategy.Decision.AVAILABLE
        )
        avoided = tuple(b for b in order if b != q.broker_name) if how != "home" else ()
        return Choice(strategy.Selection(q, decision, avoided, counter), av, how)
    if config.selection == "p2c-ewma":
        q2 = p2c_pick(
            route, av.enforced, last_broker, scores or {}, draws.p2c_first, draws.p2c_second
        )
        if q2 is not None:
            avoided = tuple(b for b in order if b != q2.broker_name)
            sel = strategy.Selection(q2, strategy.Decision.AVAILABLE, avoided, counter + 1)
            return Choice(sel, av)
    if not local and not av.unenforced and not probation_on(config) and not config.ramp_ms:
        return Choice(strategy.select(route, counter, faults, now_ms, last_broker, True), av)
    sel = strategy.select(
        route, counter, _with_local(faults, local), now_ms, last_broker, True, av.enforced
    )
    return Choice(sel, av)


def _probe(
    route: Route,
    counter: int,
    av: Avoidance,
    probes: Collection[str],
    last_broker: str | None,
    sharding_key: str | None,
    order: list[str],
) -> Choice | None:
    if sharding_key is not None:
        home = route.queues[shard_index(sharding_key, len(route.queues))]
        if home.broker_name not in probes or home.broker_name not in av.enforced:
            return None
        avoided = tuple(b for b in order if b != home.broker_name)
        sel = strategy.Selection(home, strategy.Decision.AVAILABLE, avoided, counter)
        return Choice(sel, av, "home", home.broker_name)
    for broker in sorted(b for b in route.by_broker if b in probes and b in av.enforced):
        if broker == last_broker:
            continue
        queues = route.by_broker[broker]
        q = queues[counter % len(queues)]
        avoided = tuple(b for b in order if b != broker)
        sel = strategy.Selection(q, strategy.Decision.AVAILABLE, avoided, counter + 1)
        return Choice(sel, av, None, broker)
    return None


# ---------------------------------------------------------------- reports: quorum and backoff


def counts_toward_quorum(config: Config, isolation: bool, origin: str | None) -> bool:
    """A failure waits for the quorum unless the broker itself answered with the error.

    ``origin: "broker"`` (an error reply, a slow answer) says nothing about the
    producer's own network, so it isolates at once, as Envoy's split of external
    and local-origin errors does; ``"local"`` and an unstated origin (a connect
    refused or a timeout can be either side's fault) need the quorum.
    """
    return isolation and config.isolation_quorum > 1 and origin != "broker"


def quorum_step(
    suspects: tuple[tuple[str, int], ...],
    producer: str,
    at_ms: int,
    now_ms: int,
    config: Config,
) -> tuple[tuple[tuple[str, int], ...], bool]:
    """Add a failure by ``producer`` at ``at_ms``; (suspects after, quorum reached).

    Distinct producers with a failure within ``quorumWindowMs`` of ``now`` count.
    When the quorum is reached the suspects are cleared (the broker is isolated
    for everyone). Entries are kept while their producer's own window lasts
    (``producer_windows``), at most ``MAX_SUSPECTS`` of the newest.
    """
    suspects, reached, _ = quorum_vote(suspects, producer, at_ms, now_ms, config)
    return suspects, reached


def quorum_vote(
    suspects: tuple[tuple[str, int], ...],
    producer: str,
    at_ms: int,
    now_ms: int,
    config: Config,
) -> tuple[tuple[tuple[str, int], ...], bool, int]:
    """``quorum_step`` with the number of voters counted (the event log records it)."""
    keep_ms = max(config.quorum_window_ms, strategy.report_duration(config, 0, True))
    kept = [(p, a) for p, a in suspects if p != producer and a > now_ms - keep_ms]
    prev = [a for p, a in suspects if p == producer]
    at = max([at_ms, *prev])
    entries = sorted([*kept, (producer, at)], key=lambda e: (e[1], e[0]))[-MAX_SUSPECTS:]
    voters = {p for p, a in entries if a > now_ms - config.quorum_window_ms}
    if len(voters) >= config.isolation_quorum:
        return (), True, len(voters)
    return tuple(entries), False, len(voters)


def counts_toward_latency_quorum(
    config: Config, isolation: bool, duration_ms: int, origin: str | None
) -> bool:
    """A slow answer waits for the latency quorum unless the broker said it was the cause.

    Only answers whose tier has a window count (faster ones open nothing anyway);
    ``origin: "broker"`` (the broker reported itself busy or slow) decides at once, as
    for failures; a latency measured by the producer alone may be its own connection
    set-up, GC pause or CPU starvation.
    """
    return not isolation and duration_ms > 0 and config.latency_quorum > 1 and origin != "broker"


def latency_vote(
    slow: tuple[tuple[str, int, int], ...],
    producer: str,
    at_ms: int,
    end_ms: int,
    now_ms: int,
    config: Config,
) -> tuple[tuple[tuple[str, int, int], ...], bool, int]:
    """Add ``producer``'s slow answer at ``at_ms`` (its own window ending ``end_ms``);
    (slow votes after, latency quorum reached, voters).

    As ``quorum_vote``: one entry per producer (its latest answer, its latest window end;
    under ``lastReportWins`` the window of this answer),
    distinct producers answering slowly within ``quorumWindowMs`` of ``now`` count; when
    they reach ``latencyQuorum`` the votes are cleared (the window opens for everyone).
    An entry is kept while it still votes or its producer's window lasts, at most
    ``MAX_SUSPECTS`` of the newest.
    """
    since = now_ms - config.quorum_window_ms
    kept = [(p, a, e) for p, a, e in slow if p != producer and (a > since or e > now_ms)]
    at, end = at_ms, end_ms
    for p, a, e in slow:
        if p == producer:
            # lastReportWins: this answer's window replaces the producer's own, as a report
            # overwrites RocketMQ's per-producer item
            at, end = max(at, a), end if config.last_report_wins else max(end, e)
    entries = sorted([*kept, (producer, at, end)], key=lambda v: (v[1], v[0]))[-MAX_SUSPECTS:]
    voters = {p for p, a, _ in entries if a > since}
    if len(voters) >= config.latency_quorum:
        return (), True, len(voters)
    return tuple(entries), False, len(voters)


def backoff(
    config: Config, base_ms: int, old: FaultItem | None, at_ms: int, jitter_roll: int
) -> tuple[int, int]:
    """(window length ms, isolation count after) for a failure at ``at_ms``.

    With ``repeatMultiplier`` off the count stays 0 and the length is ``base_ms``.
    On: the count drops by one per ``repeatDecayMs`` the broker was healthy since
    its last window ended, then rises by one when this failure opens a new window
    (a failure inside an open window keeps the count, as Envoy counts ejections,
    not errors); the length is ``base_ms * count``, capped at ``maxIsolationMs``
    but never below ``base_ms``. Jitter adds ``length * jitterPercent% *
    jitter_roll / JITTER_SCALE`` (``jitter_roll`` in 0..JITTER_SCALE-1), so many
    brokers isolated together do not come back together.
    """
    count = 0
    length = base_ms
    if config.repeat_multiplier and base_ms > 0:
        prev = old.isolations if old is not None else 0
        opens = old is None or old.available_at <= at_ms
        if opens:
            if old is not None and prev:
                prev = max(0, prev - (at_ms - old.available_at) // config.repeat_decay_ms)
            count = min(prev + 1, MAX_ISOLATIONS)
        else:
            count = max(prev, 1)
        length = max(base_ms, min(base_ms * count, config.max_isolation_ms))
    if config.jitter_percent and length > 0:
        length += length * config.jitter_percent * jitter_roll // (100 * JITTER_SCALE)
    return length, count


@dataclass(frozen=True, slots=True)
class Applied:
    """What one report did under the whole policy."""

    item: FaultItem
    #: the window length asked for (0: none, e.g. a failure short of the quorum)
    duration_ms: int
    #: index into latencyMax of the report's tier, None below every tier
    tier: int | None
    #: the failure (or slow answer) made its quorum: the window opened for everyone
    quorum_reached: bool = False
    #: the failure (or slow answer) is short of its quorum: only its producer avoids
    #: the broker
    suspected: bool = False
    #: producers behind the report: the quorum's voters, else 1
    reporters: int = 1
    #: a report on a broker on probation: "passed" (a success re-opened it to all) or
    #: "failed" (it opened a new window); None otherwise
    probe: str | None = None


def apply(
    old: FaultItem | None,
    broker_name: str,
    latency_ms: int,
    isolation: bool,
    origin: str | None,
    producer: str,
    at_ms: int,
    now_ms: int,
    config: Config,
    jitter_roll: int = 0,
    pending: bool = False,
) -> Applied:
    """The fault item after one report, avoidance on (report.lua implements the same rule).

    With the default config this is ``strategy.apply_report`` with the tier's
    duration: the quorum is 1, backoff and jitter are off. A ``pending`` report (a send
    still outstanding) follows ``apply_pending``; any other withdraws its producer's
    signal (``withdraw_pending``).
    """
    if pending:
        return apply_pending(old, broker_name, latency_ms, producer, at_ms, now_ms, config)
    tier = strategy.tier(config, latency_ms, isolation)
    duration = 0 if tier is None else config.not_available_duration[tier]
    suspects = old.suspects if old is not None else ()
    slow = old.slow if old is not None else ()
    reached = suspected = False
    reporters = 1
    if counts_toward_quorum(config, isolation, origin):
        suspects, reached, voters = quorum_vote(suspects, producer, at_ms, now_ms, config)
        reporters = voters if reached else 1
        suspected = not reached
        if suspected:
            duration = 0
    elif counts_toward_latency_quorum(config, isolation, duration, origin):
        slow, reached, voters = latency_vote(
            slow, producer, at_ms, at_ms + duration, now_ms, config
        )
        reporters = voters if reached else 1
        suspected = not reached
        if suspected:
            duration = 0
    elif config.last_report_wins and any(v[0] == producer for v in slow):
        # lastReportWins (RocketMQ 4.x) overwrites the producer's own window too, as its
        # per-producer table would: a fast answer ends it
        slow = tuple(v for v in slow if v[0] != producer)
    isolations = old.isolations if old is not None else 0
    if isolation and duration > 0:
        duration, isolations = backoff(config, duration, old, at_ms, jitter_roll)
    base = strategy.apply_report(
        old, broker_name, latency_ms, duration, at_ms, config.last_report_wins
    )
    probation = old is not None and old.probation and probation_on(config)
    probing = probation and old is not None and at_ms >= old.available_at
    probe = None
    if not probation_on(config):
        probation = False
    elif duration > 0:
        # earlyRecovery alone: a failed probe re-isolates, the window's end returns the broker
        probation = config.probe_on_expiry
        probe = "failed" if probing else None
    elif probing and not isolation:
        probation, probe = False, "passed"
    end = base.available_at
    if config.ramp_ms and duration == 0 and probe is None:
        end = ramp_end(old, end, at_ms)
    reachable = old.reachable if old is not None else None
    signals = old.pending if old is not None else ()
    if signals:
        signals, end = settle_pending(signals, producer, isolation, end, at_ms, now_ms, config)
    item = FaultItem(
        broker_name,
        latency_ms,
        end,
        isolations,
        suspects,
        probation,
        reachable,
        slow,
        signals,
    )
    return Applied(item, duration, tier, reached, suspected, reporters, probe)


# ---------------------------------------------------------------- the event log


def window_event(
    change: strategy.WindowChange,
    isolation: bool,
    quorum_reached: bool,
    probe: str | None = None,
    pending: bool = False,
) -> tuple[str, str] | None:
    """(kind, reason) of the event a report writes to the event log, or None.

    kinds: ``opened``, ``extended``, ``ended`` (early), ``quorum`` (opened because the
    quorum was reached); reasons: ``isolation`` (a failure), ``latency`` (a slow
    answer), ``quorum``, ``success`` (a report under lastReportWins ended a window).
    An operator's delete is ``("ended", "operator")``, written by the store. A probe:
    ``("ended", "probe")`` when its success re-opened the broker to all (its window had
    ended already, but selects still kept away), ``("opened", "probe")`` when it failed.
    A pending quorum (``pending``): ``("opened"|"extended", "pending")``.
    report.lua derives the same.
    """
    if probe == "passed":
        return "ended", "probe"
    if probe == "failed" and change is strategy.WindowChange.OPENED:
        return "opened", "probe"
    if change is strategy.WindowChange.NONE:
        return None
    if change is strategy.WindowChange.CLEARED:
        return "ended", "success"
    if pending:
        return ("opened" if change is strategy.WindowChange.OPENED else "extended"), "pending"
    if quorum_reached and change is strategy.WindowChange.OPENED:
        return "quorum", "quorum"
    kind = "opened" if change is strategy.WindowChange.OPENED else "extended"
    return kind, "isolation" if isolation else "latency"


# ---------------------------------------------------------------- reports kept local


def quiet(
    old: FaultItem | None,
    latency_ms: int,
    isolation: bool,
    at_ms: int,
    config: Config,
    pending: bool = False,
) -> bool:
    """Whether a report can change nothing another replica must see, whatever the table in
    the store holds beyond this replica's copy ``old`` (stale by at most one push).

    Such a report only refreshes ``currentLatencyMs`` and the latency log, which a replica
    sums locally and flushes (docs/semantics.md). The rule leans one way: a report kept
    local can never have opened, extended or ended a window, nor voted, so no window is
    lost or shortened by keeping it.

    - a failure, or a latency in a tier with a window, always goes to the store (it may
      open or extend a window, or vote);
    - a broker the copy does not hold goes (it creates the item; the table's cap is the
      store's to enforce);
    - a broker on probation goes (a success may pass the probe);
    - with ``lastReportWins`` a report over a window open at its time goes (it ends the
      window), and so does one for a broker with slow votes (``latencyQuorum``: it may end
      its producer's own window, as it would in that producer's RocketMQ table). A window
      the copy does not know yet is not ended by a report kept local:
      it stays until the next report after the push, longer, never shorter;
    - a pending report goes, and so does any report for a broker with an open in-flight
      signal (``pendingQuorum``: a completed send withdraws its producer's);
    - with the ``extend`` rule a zero-length report leaves every window as it is
      (``max(old end, at)``), whatever the store holds: it never needs the store.
    """
    if isolation or pending:
        return False
    if not config.send_latency_fault_enable:
        return True
    if old is None or old.probation:
        return False
    if any(at > 0 for _, _, at in old.pending):
        # a completed send may withdraw its producer's in-flight signal
        return False
    t = strategy.tier(config, latency_ms, False)
    if t is not None and config.not_available_duration[t] > 0:
        return False
    return not (config.last_report_wins and (old.available_at > at_ms or bool(old.slow)))


# ---------------------------------------------------------------- recovery: ramp and early return


#: The staggered return's first share of selects is 1/2**RAMP_STEPS, doubled every
#: rampMs/RAMP_STEPS until it is all of them.
RAMP_STEPS = 6


def probation_on(config: Config) -> bool:
    """Whether a broker's probation flag is obeyed: probeOnExpiry, or earlyRecovery (which
    puts a broker the detector found back on probation before its window ends)."""
    return config.probe_on_expiry or config.early_recovery


def ramp_share(item: FaultItem, now_ms: int, config: Config) -> float:
    """The share of selects a broker gets ``now`` (rampMs): 1 inside its window (the window
    decides) and from ``rampMs`` after it ended; in between 1/64, doubling every rampMs/6.

    An item whose end is 0 never had a window (``ramp_end``): full share. Integer steps, so
    every decider computes the same share from the same clock.
    """
    since = now_ms - item.available_at
    if not config.ramp_ms or since < 0 or since >= config.ramp_ms or item.available_at == 0:
        return 1.0
    step = since * RAMP_STEPS // config.ramp_ms
    return float(1 << step) / (1 << RAMP_STEPS)


def ramp_skips(item: FaultItem, now_ms: int, config: Config, roll: float) -> bool:
    """Whether a select whose ramp draw is ``roll`` (uniform in [0, 1)) skips this broker,
    still ramping up after its window: the roll lost (``roll >= share``)."""
    return roll >= ramp_share(item, now_ms, config)


def ramp_end(old: FaultItem | None, end: int, at_ms: int) -> int:
    """The window end a report that opens no window leaves under rampMs: the last window's
    end stays (the ramp counts from it; a healthy report would otherwise move it to the
    report's time and restart the ramp), 0 on a new item (it never had a window). A report
    inside an open window is RocketMQ's (``end``, the rule's)."""
    if old is None:
        return 0
    return old.available_at if old.available_at <= at_ms else end


def reach(item: FaultItem, reachable: bool, now_ms: int, config: Config) -> FaultItem:
    """The item after the active detector's reading (reach.lua implements the same rule).

    The reading is kept (``reachable``). With earlyRecovery, a broker in an open window that
    the detector had found refusing connections (``reachable`` False) and now reaches is
    evidence the broker is back: its window ends now and it goes on probation, so the next
    select probes it (``on_probation``). A first reading never counts (a hung or slow
    process accepts connections too: only a refusal then an accept says it restarted). A
    repeat offender (``isolations`` above 1: repeatMultiplier counted it isolated again
    within repeatDecayMs, e.g. a flapping broker) waits out its window.
    """
    if (
        config.early_recovery
        and config.send_latency_fault_enable
        and reachable
        and item.reachable is False
        and item.isolations <= 1
        and now_ms < item.available_at
    ):
        return replace(item, available_at=now_ms, probation=True, reachable=True)
    return replace(item, reachable=reachable)


# ---------------------------------------------------------------- in-flight signals


def pending_tier(config: Config, latency_ms: int) -> int | None:
    """The tier whose window a pending quorum opens: the pending latency's own, or, when
    that opens nothing (the usual case: a signal comes at a few times the broker's p99,
    far below 550 ms), the first tier that opens a window. None: no tier has a window.

    The producer's signal already says "far longer than this broker's normal latency";
    waiting for the send to reach a windowed tier would wait for the timeout itself.
    """
    t = strategy.tier(config, latency_ms)
    if t is not None and config.not_available_duration[t] > 0:
        return t
    return next((i for i, d in enumerate(config.not_available_duration) if d > 0), None)


def pending_duration(config: Config, latency_ms: int) -> int:
    """Window length (ms) a pending quorum opens for a send outstanding ``latency_ms``."""
    t = pending_tier(config, latency_ms)
    return 0 if t is None else config.not_available_duration[t]


Signals = tuple[tuple[str, int, int], ...]
#: The entry that marks a window held by signals alone: (HOLD, window end, 0). No producer
#: id can contain ``~`` (the API's pattern), so it never counts as one.
HOLD = "~"


def live_signals(pending: Signals, now_ms: int, config: Config) -> set[str]:
    """Producers with an open signal signalled within ``quorumWindowMs`` of ``now``."""
    since = now_ms - config.quorum_window_ms
    return {p for p, _, at in pending if at > 0 and at > since and p != HOLD}


def held_until(pending: Signals) -> int:
    """The end of the window the signals alone hold open (0: none)."""
    return next((s for p, s, _ in pending if p == HOLD), 0)


def settle_pending(
    pending: Signals,
    producer: str,
    isolation: bool,
    end_ms: int,
    at_ms: int,
    now_ms: int,
    config: Config,
) -> tuple[Signals, int]:
    """A report that is not pending, on a broker with signals: (signals after, window end).

    It withdraws its producer's signal (``withdraw_pending``). A window the signals hold
    (a pending quorum opened or last moved it, ``HOLD``) that another report has moved
    since belongs to that report now: it is no longer held. One still held ends at this
    report when the report is a completed send (not a failure: a timeout confirms the
    hang) and the live signals are short of ``pendingQuorum``: the sends that looked hung
    were answered, the broker was slow for a moment, not hung.
    """
    pending = withdraw_pending(pending, producer, at_ms, now_ms, config)
    hold = held_until(pending)
    if not hold:
        return pending, end_ms
    released = tuple(e for e in pending if e[0] != HOLD)
    if end_ms != hold:
        return released, end_ms
    if not isolation and len(live_signals(pending, now_ms, config)) < config.pending_quorum:
        return released, min(end_ms, at_ms)
    return pending, end_ms


def pending_vote(
    pending: Signals, producer: str, since_ms: int, at_ms: int, now_ms: int, config: Config
) -> tuple[Signals, bool]:
    """Record ``producer``'s signal for a send outstanding since ``since_ms``, made at
    ``at_ms``; (signals after, accepted).

    One entry per producer (a re-signal refreshes it). A signal for a send that started
    before the producer's last completed send on this broker (its withdrawn entry) is
    stale, a late arrival for a send that has finished: not accepted, nothing changes.
    Entries older than ``quorumWindowMs`` are dropped; at most ``MAX_SUSPECTS`` of the
    newest are kept.
    """
    mine = next((e for e in pending if e[0] == producer), None)
    if mine is not None and mine[2] == 0 and since_ms <= mine[1]:
        return pending, False
    if mine is not None and mine[2] > 0:
        since_ms, at_ms = min(since_ms, mine[1]), max(at_ms, mine[2])
    return _bounded(pending, producer, (producer, since_ms, at_ms), now_ms, config), True


def withdraw_pending(
    pending: Signals, producer: str, at_ms: int, now_ms: int, config: Config
) -> Signals:
    """A completed send (any report that is not pending) of ``producer`` at ``at_ms``
    withdraws its signal: the entry becomes (producer, at_ms, 0), which turns away a late
    signal for a send that started before it. Nothing is added for a producer without an
    entry (the list only ever holds producers that signalled)."""
    mine = next((e for e in pending if e[0] == producer), None)
    if mine is None:
        return pending
    done = max(at_ms, mine[1]) if mine[2] == 0 else at_ms
    return _bounded(pending, producer, (producer, done, 0), now_ms, config)


def _bounded(
    pending: Signals, producer: str, entry: tuple[str, int, int], now_ms: int, config: Config
) -> Signals:
    since = now_ms - config.quorum_window_ms
    kept = [e for e in pending if e[0] != producer and max(e[1], e[2]) > since]
    entries = sorted([*kept, entry], key=lambda e: (max(e[1], e[2]), e[0]))
    return tuple(entries[-MAX_SUSPECTS:])


def apply_pending(
    old: FaultItem | None,
    broker_name: str,
    latency_ms: int,
    producer: str,
    at_ms: int,
    now_ms: int,
    config: Config,
) -> Applied:
    """The fault item after a pending report: a send to the broker outstanding for
    ``latency_ms`` at ``at_ms`` (report.lua implements the same rule).

    With ``pendingQuorum`` 0 nothing changes (no item is created). Otherwise the signal
    is recorded (``pending_vote``); when distinct producers with a live signal reach
    ``pendingQuorum`` the window of ``pending_tier`` opens for everyone, extend-only
    (whatever ``lastReportWins`` says: a signal is no answer that could end a window),
    held by the signals until their sends complete (``settle_pending``).
    ``currentLatencyMs`` stays: no send has completed.
    """
    # A broker's first report being a signal creates an item whose window never opened
    # (end 0), not one ending at the signal: a replica's clock, a little behind the
    # store's by design (it errs toward avoiding), would see that end as a window.
    if config.pending_quorum == 0 or not config.send_latency_fault_enable:
        item = old if old is not None else FaultItem(broker_name, 0, 0)
        return Applied(item, 0, None)
    t = pending_tier(config, latency_ms)
    duration = 0 if t is None else config.not_available_duration[t]
    base = old if old is not None else FaultItem(broker_name, 0, 0)
    signals, accepted = pending_vote(
        base.pending, producer, at_ms - latency_ms, at_ms, now_ms, config
    )
    if not accepted or duration == 0:
        return Applied(base, 0, t)
    voters = live_signals(signals, now_ms, config)
    if len(voters) < config.pending_quorum:
        return Applied(replace(base, pending=signals), 0, t, suspected=True)
    end = base.available_at
    if at_ms + duration > end:
        # the signals hold the window (``settle_pending`` may end it early); the signals
        # stay: each completed send withdraws its own
        end = at_ms + duration
        signals = _bounded(signals, HOLD, (HOLD, end, 0), now_ms, config)
    item = replace(base, available_at=end, pending=signals)
    return Applied(item, duration, t, quorum_reached=True, reporters=len(voters))
