"""Power of two choices on peak-EWMA latency (selection: p2c-ewma), Finagle's balancer."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

from detour.model import Queue, Route

#: Time constant (ms) of the peak-EWMA latency, Finagle's default decay window.
EWMA_DECAY_MS = 10_000.0
#: Time constant (ms) by which a score fades while its broker gets no reports: without
#: it a broker that had one slow answer would never be chosen again, so never measured.
IDLE_DECAY_MS = 1_000.0


def peak_ewma(old: float | None, old_at_ms: int, sample_ms: float, now_ms: int) -> float:
    """Finagle's peak EWMA: jump up to a slower sample at once, decay toward faster ones.

    A broker that just got slow is penalised immediately; one that recovers earns
    its way back over ``EWMA_DECAY_MS``.
    """
    if old is None or sample_ms >= old:
        return float(sample_ms)
    w = math.exp(-max(0, now_ms - old_at_ms) / EWMA_DECAY_MS)
    # Between the sample and the old value, as a weighted mean is: the float sum can round
    # one unit past ``old`` (tests/test_policy.py test_peak_ewma found 65537.0 over
    # 65536.99999999999).
    return min(old, max(float(sample_ms), old * w + sample_ms * (1 - w)))


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
