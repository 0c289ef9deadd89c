"""In-flight signals (pendingQuorum): sends still outstanding that, from enough producers,
avoid a broker before any timeout fires."""

from __future__ import annotations

from detour import strategy
from detour.model import Config
from detour.policy.votes import MAX_SUSPECTS


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
    return bounded_signals(pending, producer, (producer, since_ms, at_ms), now_ms, config), True


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
    return bounded_signals(pending, producer, (producer, done, 0), now_ms, config)


def bounded_signals(
    pending: Signals, producer: str, entry: tuple[str, int, int], now_ms: int, config: Config
) -> Signals:
    since = now_ms - config.quorum_window_ms
    kept = [e for e in pending if e[0] != producer and max(e[1], e[2]) > since]
    entries = sorted([*kept, entry], key=lambda e: (max(e[1], e[2]), e[0]))
    return tuple(entries[-MAX_SUSPECTS:])
