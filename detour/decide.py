"""The one select: every decision Detour makes or lets a producer make goes through ``decide``.

``POST /select`` (through ``service.selector``, the route lookup), the SDK's cached mode
and its fail-open mode (``detour.client.local``) and the decision vectors
(docs/vectors/generate.py, docs/vectors/select.json) all call it, with the whole config,
the producer's windows, the probes and the p2c scores, so a producer deciding in-process
makes the decision the service would make on the same table with the same random draws.

Pure, like the rest of the core: the table comes in as plain values, the random draws
are made by the caller (``draw`` says which, from a generator the caller owns), no clock
is read.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from detour.model import Config, FaultItem, Route
from detour.policy import Choice, Draws, choose, probation_on

#: What a select gets when no rule of its config needs a random value.
NO_DRAWS = Draws()
#: No p2c scores (a select whose config does not read them).
NO_SCORES: Mapping[str, float] = MappingProxyType({})


class Table(NamedTuple):
    """What one select reads of a replica's (or a producer's) copy of the table.

    A NamedTuple, like ``Ask``: immutable and cheap to build on every select (as frozen
    dataclasses, whose ``__init__`` sets each field through ``object.__setattr__``, they
    made a select measurably slower: docs/BENCHMARKS.md, "One select everywhere").
    """

    route: Route
    config: Config
    faults: Mapping[str, FaultItem]
    #: the topic's round-robin position
    counter: int
    #: epoch ms on the clock the windows are written in
    now_ms: int
    #: peak-EWMA latency per broker (ms), read only with ``selection: p2c-ewma``
    scores: Mapping[str, float] = NO_SCORES
    #: brokers on probation this select may probe (``policy.probe_free``), read only with
    #: ``probeOnExpiry`` or ``earlyRecovery``
    probes: Collection[str] = ()


class Ask(NamedTuple):
    """What a producer asks with: the fields of ``POST /select`` beyond the topic."""

    last_broker: str | None = None
    #: who asks: its own failures short of the isolation quorum are avoided for it
    producer: str | None = None
    sharding_key: str | None = None


def needs_draws(config: Config) -> bool:
    """Whether a select under ``config`` reads any random draw (enforcement share, p2c,
    the staggered return's roll)."""
    return config.enforcement_percent < 100 or config.selection == "p2c-ewma" or config.ramp_ms > 0


def draw(config: Config, rng: random.Random) -> Draws:
    """The random values one select under ``config`` uses, from the caller's generator.

    Drawn in one order (enforcement roll, then the two p2c draws of 32 bits, then the ramp
    roll, last so the others' sequence is the same without it), so a generator seeded alike
    gives the service and the SDK the same draws.
    """
    if not needs_draws(config):
        return NO_DRAWS
    enforce = rng.random() if config.enforcement_percent < 100 else 0.0
    first, second = rng.getrandbits(32), rng.getrandbits(32)
    return Draws(enforce, first, second, rng.random() if config.ramp_ms else 0.0)


def decide(table: Table, ask: Ask, draws: Draws = NO_DRAWS) -> Choice:
    """One select with every policy field: the queue, why, and the counter to keep.

    Raises ValueError when the route has no queue.
    """
    config = table.config
    return choose(
        table.route,
        table.counter,
        table.faults,
        table.now_ms,
        ask.last_broker,
        config,
        draws,
        ask.producer,
        ask.sharding_key,
        table.scores if config.selection == "p2c-ewma" else None,
        table.probes if probation_on(config) else (),
    )


def answer(choice: Choice) -> dict[str, Any]:
    """The decision as the decision vectors record it: ``POST /select``'s decision fields
    (camelCase, ``probe`` a boolean) plus ``nextCounter``, the topic's position after it."""
    sel, av = choice.selection, choice.avoidance
    return {
        "brokerName": sel.queue.broker_name,
        "queueId": sel.queue.queue_id,
        "decision": sel.decision.value,
        "avoidedBrokers": list(sel.avoided_brokers),
        "panic": av.panic,
        "dryRun": av.dry_run,
        "unenforcedBrokers": list(av.unenforced),
        "ordered": choice.ordered,
        "probe": choice.probe is not None,
        "nextCounter": sel.next_counter,
    }
