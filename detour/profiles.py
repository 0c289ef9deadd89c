"""Named configs: what a new table starts with, and exact RocketMQ 4.x one word away.

A table shared by many producers changes the blast radius of one producer's noise: with
RocketMQ's rules a single slow cold send (a JIT warm-up, a GC pause, a connection set up)
avoids a healthy broker for every producer for up to minutes. So a new table starts from
``recommended``, docs/policy.md's settings that together meet every efficacy target
(docs/BENCHMARKS.md, "Out of the box"): a slow answer affects only its own producer until
another agrees (``latencyQuorum`` 2, which is what a per-producer RocketMQ table does),
and the recovery and in-flight settings. ``rocketmq-4`` is every field at its RocketMQ 4.x
value: exactly docs/semantics.md, which the conformance tests check.

Each field's own default (``Config()``, what a merge patch's ``null`` puts back) stays
RocketMQ's: a profile is a whole config, never a change of what one field means.
"""

from __future__ import annotations

from detour.model import Config

#: Exact RocketMQ 4.x (MQFaultStrategy, LatencyFaultToleranceImpl): every field's default.
ROCKETMQ_4 = Config()

#: docs/policy.md, "The recommended settings together", plus latencyQuorum 2.
RECOMMENDED = Config(
    latency_quorum=2,
    repeat_multiplier=True,
    detector_enable=True,
    detect_interval_ms=500,
    ramp_ms=3000,
    early_recovery=True,
    pending_quorum=2,
)

PROFILES: dict[str, Config] = {"recommended": RECOMMENDED, "rocketmq-4": ROCKETMQ_4}

#: The profile a table starts with when nothing was ever written to it.
DEFAULT_PROFILE = "recommended"


def profile_of(config: Config) -> str | None:
    """The profile whose every field ``config`` has, or None (a config of its own)."""
    for name, profile in PROFILES.items():
        if config == profile:
            return name
    return None
