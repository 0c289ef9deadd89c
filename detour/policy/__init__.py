"""Avoidance policy beyond RocketMQ, pure: one module per concern, every knob off by default.

- ``keyed``: keyed (ordered) selects, a sharding key's queue and its fallback
- ``avoidance``: which open windows a select obeys (own windows, dry run, cap, panic)
- ``p2c``: power of two choices on peak-EWMA latency
- ``choose``: one select under the whole policy
- ``votes``: the isolation and latency quorums
- ``backoff``: repeat-offender backoff and jitter
- ``pending``: in-flight signals (pendingQuorum)
- ``probation``: probe sends after a window (probeOnExpiry, earlyRecovery)
- ``recovery``: the staggered return (rampMs) and the detector's early return
- ``quiet``: which reports a replica may keep local
- ``events``: the event log's words for what a report did

Like ``detour.strategy`` nothing here does I/O or reads a clock or a random source:
``now`` and every random draw come in as arguments, so the stores, the API, the SDK and
the tests share one implementation and tests are deterministic. With a default
``Config`` every function reduces to RocketMQ's behaviour (``strategy``); the rule that
applies reports is ``detour.apply``. docs/policy.md explains each knob, the peer it comes
from and how Detour differs. The names are re-exported here: ``policy.quiet(...)``.
"""

from detour.policy.avoidance import (
    NOTHING_AVOIDED,
    Avoidance,
    avoidance,
    producer_windows,
    with_local,
)
from detour.policy.backoff import JITTER_SCALE, MAX_ISOLATIONS, backoff
from detour.policy.choose import Choice, Draws, choose
from detour.policy.events import window_event
from detour.policy.keyed import ordered_pick, shard_index
from detour.policy.p2c import EWMA_DECAY_MS, IDLE_DECAY_MS, idle_score, p2c_pick, peak_ewma
from detour.policy.pending import (
    HOLD,
    Signals,
    bounded_signals,
    held_until,
    live_signals,
    pending_duration,
    pending_tier,
    pending_vote,
    settle_pending,
    withdraw_pending,
)
from detour.policy.probation import on_probation, probation_on, probe_free
from detour.policy.quiet import quiet
from detour.policy.recovery import RAMP_STEPS, ramp_end, ramp_share, ramp_skips, reach
from detour.policy.votes import (
    MAX_SUSPECTS,
    counts_toward_latency_quorum,
    counts_toward_quorum,
    latency_vote,
    quorum_step,
    quorum_vote,
)

__all__ = [
    "EWMA_DECAY_MS",
    "HOLD",
    "IDLE_DECAY_MS",
    "JITTER_SCALE",
    "MAX_ISOLATIONS",
    "MAX_SUSPECTS",
    "NOTHING_AVOIDED",
    "RAMP_STEPS",
    "Avoidance",
    "Choice",
    "Draws",
    "Signals",
    "avoidance",
    "backoff",
    "bounded_signals",
    "choose",
    "counts_toward_latency_quorum",
    "counts_toward_quorum",
    "held_until",
    "idle_score",
    "latency_vote",
    "live_signals",
    "on_probation",
    "ordered_pick",
    "p2c_pick",
    "peak_ewma",
    "pending_duration",
    "pending_tier",
    "pending_vote",
    "probation_on",
    "probe_free",
    "producer_windows",
    "quiet",
    "quorum_step",
    "quorum_vote",
    "ramp_end",
    "ramp_share",
    "ramp_skips",
    "reach",
    "settle_pending",
    "shard_index",
    "window_event",
    "with_local",
    "withdraw_pending",
]
