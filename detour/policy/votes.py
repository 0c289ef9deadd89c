"""Quorums: how many distinct producers must agree before a failure (isolationQuorum) or a
slow answer (latencyQuorum) opens a window for everyone."""

from __future__ import annotations

from detour import strategy
from detour.model import Config

#: Suspects (and slow votes, and in-flight signals) kept per broker: enough for any quorum,
#: bounded so one item stays small.
MAX_SUSPECTS = 128


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
