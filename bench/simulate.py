"""``python -m bench.simulate``: avoidance efficacy at fleet scale, in virtual time.

Why a simulation: a thousand producer processes do not fit on this machine,
and the claim to test is about how failed attempts *scale* with the number of
producers. The decisions are not modelled: every select and every report goes
through ``detour.strategy`` itself (imported, never copied), over
``detour.model`` routes and fault items, exactly as the SDK's local table and
the service do. What is modelled is the world around them: brokers, latencies,
faults and time.

The world (defaults; every number is a flag):

* ``--producers`` producers (1,000), each sending ``--rate`` messages per
  second (1) at a fixed phase, open loop (a slow send does not delay the next
  one, as with an async producer or several sending threads), RocketMQ's loop:
  up to 3 attempts within a 3 s deadline, a retry passing the failed broker as
  ``last_broker``.
* ``--brokers`` brokers (100) with 4 write queues each. A healthy send takes a
  log-normal time (median 3 ms, sigma 0.7: p99 about 15 ms).
* Faults, at random times on distinct brokers, the same for every strategy and
  every producer count (they depend on the seed and the broker count only):
  **crash** (connections refused at once, 60-300 s, then back), **hang** (sends
  time out after ``--timeout-ms`` 1,000, 20-120 s), **slow** (600-900 ms added
  to every send, 120-600 s: RocketMQ's 550 ms tier, a 30 s window) and
  **flapping** (refused 1-3 s, fine 5-15 s, over and over for 120-480 s).
  Six of each kind per simulated hour, three flapping.
* Tiers: RocketMQ's defaults, unscaled (virtual time costs nothing): a failure
  avoids a broker for 600 s, a 550 ms send for 30 s.

Strategies, each over the same faults:

``no-avoidance``
    ``sendLatencyFaultEnable=false``: round robin, a retry skips the broker
    that just failed.
``per-producer``
    RocketMQ 4.x: each producer its own fault table, updated by its own reports
    only.
``detour-<delay>``
    One shared table (Detour): every report reaches every producer's table
    ``<delay>`` after the send completed (1 ms, 100 ms, 1 s by default:
    ``--delays``); the reporting producer applies its own report at once, as the
    SDK does. Producers keep their own round-robin counters (cached mode).
``detour-recover-<delay>``
    The same with the recovery settings docs/policy.md recommends (``RECOVER``):
    the staggered return (``rampMs`` 3000), early recovery with the active
    detector every 500 ms (a crashed or flapping broker reads unreachable, any
    other reachable; its reading reaches the producers ``<delay>`` later) and
    ``repeatMultiplier``. These selects and reports go through ``detour.policy``
    (``choose`` while a broker ramps up or waits for its probe, ``apply``, ``reach``):
    each producer hands out its own probes, as the SDK's cached mode does.
``detour-pending``
    ``detour-100ms`` (the middle delay) with the recommended in-flight signals
    (``pendingQuorum`` 2): a send outstanding past the SDK's threshold (``max(50
    ms, 4 x the latency model's p99)``) signals; the signal reaches the shared table
    ``<delay>`` later, and every report goes through ``detour.apply.apply_one``
    (which withdraws the signal). docs/policy.md, "Hangs".
``detour-all``
    ``detour-100ms`` with every recommended setting at once: the recovery
    settings and the in-flight signals.

Counted: a *bad attempt* is one that failed (refused or timed out) or took at
least 550 ms (the first tier that opens a window). Bad attempts are
attributed to the fault active on their broker when they started; the figure
per fault kind is bad attempts per fault. Also: messages that exhausted their
attempts, message latency (all attempts), the time from a fault's start to its
last bad attempt, and from its end to the broker's first good send.

Two simplifications, both in the strategies' favour equally: a report that
opens no window (a healthy send) is applied when the send starts, not when it
ends, and reaches the shared table without delay; under the extend rule it
changes no window, only ``currentLatencyMs`` (which only pickOneAtLeast reads).
A send's outcome is fixed by its broker's state when it starts (a hang that
ends during a send answers it when it ends).

Speed: one heap of events in integer virtual milliseconds; messages start in a
precomputed order (producers sorted by phase), so the heap only holds sends
still in flight past a failure and fault transitions. Random latencies are
drawn with numpy up front. A simulated hour with 1,000 producers (3.6 million
messages) takes 10-30 s per strategy here; ``--jobs 2`` runs strategies in two
processes.

    python -m bench.simulate                                   # 1,000 producers, an hour
    python -m bench.simulate --producers 1,10,100,1000 --img docs/img
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import math
import os
import platform
import sys
import time
from array import array
from collections import ChainMap, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from detour import policy, strategy
from detour.apply import ReportIn, apply_one
from detour.model import BrokerRoute, Config, FaultItem, Route


def _apply(
    old: FaultItem | None,
    name: str,
    ms: int,
    failed: bool,
    producer: str,
    at: int,
    now: int,
    config: Config,
) -> FaultItem:
    """The table's item after one report at ``at`` seen at ``now`` (the one rule)."""
    item = apply_one(old, ReportIn(name, ms, failed, now - at, producer), now, config).item
    assert item is not None  # avoidance is on in every arm that calls it
    return item

TOPIC = "sim"
#: A send at least this long is a bad attempt: RocketMQ's first tier that opens a window.
SLOW_MS = 550
KINDS = ("crash", "hang", "slow", "flapping")

# broker states
UP, REFUSED, HANG, SLOW = 0, 1, 2, 3
# heap events
EV_STATE, EV_DONE, EV_DETECT, EV_REACH, EV_SIGNAL = 0, 1, 2, 3, 4
#: The recovery arms' config (docs/policy.md's recommended recovery settings).
RECOVER = Config(ramp_ms=3000, early_recovery=True, detector_enable=True,
                 detect_interval_ms=500, repeat_multiplier=True)
#: The detour-pending arm's pendingQuorum and the SDK's signal rule (detour.client.inflight)
PENDING_QUORUM = 2
PENDING_FACTOR, PENDING_FLOOR_MS = 4.0, 50.0

_SAMPLES = 1 << 20
_MASK = _SAMPLES - 1


@dataclass(frozen=True)
class World:
    """Everything but the strategy and the producer count: the same for every arm."""

    brokers: int = 100
    queues: int = 4
    duration_s: int = 3600
    rate: float = 1.0
    timeout_ms: int = 1000
    retries: int = 2
    deadline_ms: int = 3000
    refused_ms: int = 1
    latency_median_ms: float = 3.0
    latency_sigma: float = 0.7
    #: faults per simulated hour, by kind
    per_hour: tuple[tuple[str, float], ...] = (
        ("crash", 6), ("hang", 6), ("slow", 6), ("flapping", 3),
    )
    seed: int = 1


@dataclass(frozen=True)
class SimFault:
    id: int
    kind: str
    broker: int
    start_ms: int
    end_ms: int
    #: slow: ms added to every send
    extra_ms: int = 0
    #: flapping: the (down, up) cycle
    down_ms: int = 0
    up_ms: int = 0


@dataclass(frozen=True)
class Arm:
    name: str
    #: "none", "per-producer" or "detour"
    kind: str
    delay_ms: int = 0
    #: a Detour arm with the recovery settings (``RECOVER``)
    recover: bool = False
    #: pendingQuorum (0: no in-flight signals)
    pending: int = 0


def arms(delays_ms: Sequence[int] = (1, 100, 1000)) -> list[Arm]:
    out = [Arm("no-avoidance", "none"), Arm("per-producer", "per-producer")]
    for d in delays_ms:
        label = f"{d // 1000} s" if d >= 1000 and d % 1000 == 0 else f"{d} ms"
        out.append(Arm(f"detour-{label.replace(' ', '')}", "detour", d))
    for d in delays_ms:
        label = f"{d // 1000} s" if d >= 1000 and d % 1000 == 0 else f"{d} ms"
        out.append(Arm(f"detour-recover-{label.replace(' ', '')}", "detour", d, recover=True))
    # the recommended in-flight signals, at the middle delay
    middle = sorted(delays_ms)[len(delays_ms) // 2]
    out.append(Arm("detour-pending", "detour", middle, pending=PENDING_QUORUM))
    # every recommended setting at once (docs/policy.md)
    out.append(Arm("detour-all", "detour", middle, recover=True, pending=PENDING_QUORUM))
    return out


def broker_names(n: int) -> list[str]:
    return [f"b{i:03d}" for i in range(n)]


def schedule(world: World) -> list[SimFault]:
    """The faults: random starts in the middle 5 % - 75 % of the run, distinct brokers.

    Lengths are capped at a fifth of the run so a short run (a test) still sees
    every fault end.
    """
    rng = np.random.default_rng([world.seed, 7])
    dur = world.duration_s * 1000
    cap = dur // 5
    kinds: list[str] = []
    for kind, per_hour in world.per_hour:
        kinds += [kind] * max(1, round(per_hour * world.duration_s / 3600))
    n = len(kinds)
    picked = rng.choice(world.brokers, size=n, replace=n > world.brokers)
    faults: list[SimFault] = []
    for i, (kind, broker) in enumerate(zip(kinds, picked, strict=True)):
        start = int(rng.uniform(0.05, 0.75) * dur)
        lo, hi = {"crash": (60, 300), "hang": (20, 120), "slow": (120, 600),
                  "flapping": (120, 480)}[kind]
        length = min(cap, int(rng.uniform(lo, hi) * 1000))
        extra = int(rng.uniform(600, 900)) if kind == "slow" else 0
        down = int(rng.uniform(1000, 3000)) if kind == "flapping" else 0
        up = int(rng.uniform(5000, 15000)) if kind == "flapping" else 0
        faults.append(SimFault(i, kind, int(broker), start, start + length, extra, down, up))
    return faults


def transitions(faults: Sequence[SimFault]) -> list[tuple[int, int, int, int, int]]:
    """(time ms, broker, state, fault id or -1 at the end, hang end ms), in time order."""
    out: list[tuple[int, int, int, int, int]] = []
    for f in faults:
        if f.kind == "crash":
            out.append((f.start_ms, f.broker, REFUSED, f.id, 0))
        elif f.kind == "hang":
            out.append((f.start_ms, f.broker, HANG, f.id, f.end_ms))
        elif f.kind == "slow":
            out.append((f.start_ms, f.broker, SLOW, f.id, f.extra_ms))
        else:
            t = f.start_ms
            while t < f.end_ms:
                out.append((t, f.broker, REFUSED, f.id, 0))
                up = min(t + f.down_ms, f.end_ms)
                if up < f.end_ms:
                    out.append((up, f.broker, UP, f.id, 0))
                t = up + f.up_ms
        out.append((f.end_ms, f.broker, UP, -1, f.id))
    out.sort(key=lambda x: (x[0], x[1]))
    return out


@dataclass
class ArmResult:
    arm: str
    producers: int
    messages: int = 0
    attempts: int = 0
    failed_attempts: int = 0
    slow_attempts: int = 0
    exhausted: int = 0
    wall_s: float = 0.0
    #: per fault kind: faults, bad attempts, bad per fault, median s to the last bad attempt,
    #: median s from the end to the first good send
    kinds: dict[str, dict[str, float]] = field(default_factory=dict)
    #: per fault: id, kind, bad attempts, s to last bad attempt, s to first good send after
    faults: list[dict[str, Any]] = field(default_factory=list)
    latency_ms: dict[str, float] = field(default_factory=dict)
    #: the message latency CDF at ``CDF_POINTS`` (fraction of messages at or below)
    cdf: list[float] = field(default_factory=list)
    #: bad attempts per minute of virtual time
    per_minute: list[int] = field(default_factory=list)


#: Latencies (ms) at which the CDF is kept: log-spaced, 0.1 ms .. 10 s.
CDF_POINTS: list[float] = [round(float(x), 4) for x in np.logspace(-1, 4, 101)]


def simulate(
    world: World, arm: Arm, producers: int, tick: Callable[[int], None] | None = None
) -> ArmResult:
    """Run one strategy for ``world.duration_s`` virtual seconds; deterministic per seed.

    ``tick(n)`` is called with virtual seconds done (for a progress bar).
    """
    started = time.perf_counter()
    faults = schedule(world)
    names = broker_names(world.brokers)
    route = Route.from_brokers(TOPIC, [BrokerRoute(b, world.queues) for b in names])
    index = {b: i for i, b in enumerate(names)}
    recover = arm.recover
    pend = arm.pending > 0
    config = replace(RECOVER if recover else Config(), pending_quorum=arm.pending)
    lrw = config.last_report_wins
    enabled = arm.kind != "none"
    per_producer = arm.kind == "per-producer"
    shared = arm.kind == "detour"
    delay = arm.delay_ms
    # The same producers (counters, phases) and the same latency draws for every strategy
    # (common random numbers): differences between arms are the strategy's, not the dice's.
    rng = np.random.default_rng([world.seed, producers])
    period = round(1000 / world.rate)
    counters = [int(x) for x in rng.integers(0, 1 << 30, producers)]
    phases = [int(x) for x in rng.integers(0, period, producers)]
    mu = math.log(world.latency_median_ms)
    # the SDK's threshold on a healthy broker: factor x the latency model's p99, floored
    signal_ms = max(PENDING_FLOOR_MS, PENDING_FACTOR * math.exp(mu + 2.326 * world.latency_sigma))
    samples: list[float] = np.exp(rng.normal(mu, world.latency_sigma, _SAMPLES)).tolist()
    order = sorted(range(producers), key=lambda p: phases[p])
    phase_of = [phases[p] for p in order]
    # the recovery arms: the ramp's rolls (their own generator, so the latency draws stay
    # the other arms'), each producer's probes handed out, brokers that may ramp or probe
    rolls: list[float] = (
        np.random.default_rng([world.seed, producers, 1]).random(_SAMPLES).tolist()
        if recover else [])
    probed: list[dict[str, tuple[int, int]]] = [{} for _ in range(producers)] if recover else []
    special: set[str] = set()

    tables: list[dict[str, FaultItem]] = [{} for _ in range(producers)] if per_producer else []
    table: dict[str, FaultItem] = {}
    own: list[dict[str, FaultItem] | None] = [None] * producers
    arrivals: deque[tuple[int, int, str, int, int, bool]] = deque()
    empty: dict[str, FaultItem] = {}

    nb = world.brokers
    state = [UP] * nb
    state_arg = [0] * nb  # hang: end ms; slow: extra ms
    state_fault = [-1] * nb
    await_traffic = [-1] * nb
    ended_at = [0] * len(faults)
    bad_by_fault = [0] * len(faults)
    last_bad = [-1] * len(faults)
    first_good = [-1] * len(faults)
    minutes = world.duration_s // 60 + 2
    per_minute = [0] * minutes
    lat_out = array("f")

    heap: list[tuple[Any, ...]] = []
    seq = 0
    for t, b, s, fid, arg in transitions(faults):
        heap.append((t, seq, EV_STATE, b, s, fid, arg))
        seq += 1
    if recover:
        heap.append((0, seq, EV_DETECT))
        seq += 1
    heapq.heapify(heap)

    timeout = world.timeout_ms
    retries = world.retries
    deadline = world.deadline_ms
    refused_ms = world.refused_ms
    select = strategy.select
    report_duration = strategy.report_duration
    apply_report = strategy.apply_report
    papply = _apply
    heappush, heappop = heapq.heappush, heapq.heappop
    ks = 0
    n_attempts = n_failed = n_slow = n_exhausted = 0

    def recovering(t: int) -> bool:
        """Whether a broker ramps up or waits for its probe now (the policy decides then)."""
        gone = []
        busy = False
        for nm in special:
            item = table.get(nm)
            if item is None or (not item.probation and t - item.available_at >= config.ramp_ms):
                gone.append(nm)
            elif t >= item.available_at:
                busy = True
        special.difference_update(gone)
        return busy

    def attempt(p: int, t: int, last: str | None, n: int, elapsed: float) -> None:
        nonlocal ks, seq, n_attempts, n_failed, n_slow, n_exhausted
        view: Mapping[str, FaultItem]
        if per_producer:
            view = tables[p]
        elif shared:
            o = own[p]
            view = table if o is None else ChainMap(o, table)
        else:
            view = empty
        if recover and special and recovering(t):
            mine = probed[p]
            probes = [nm for nm in special
                      if policy.probe_free(table[nm], t, config, mine.get(nm))]
            choice = policy.choose(route, counters[p], view, t, last, config,
                                   policy.Draws(ramp=rolls[ks & _MASK]), probes=probes)
            if choice.probe is not None:
                mine[choice.probe] = (table[choice.probe].available_at, t)
            sel = choice.selection
        else:
            sel = select(route, counters[p], view, t, last, enabled)
        counters[p] = sel.next_counter
        name = sel.queue.broker_name
        b = index[name]
        s = state[b]
        lat = samples[ks & _MASK]
        ks += 1
        ok = True
        if s == REFUSED:
            lat, ok = refused_ms, False
        elif s == HANG:
            left = state_arg[b] - t
            if left < timeout:
                lat += left
            else:
                lat, ok = timeout, False
        elif s == SLOW:
            lat += state_arg[b]
            if lat >= timeout:
                lat, ok = timeout, False
        n_attempts += 1
        ms = int(lat)
        if not ok or ms >= SLOW_MS:
            if ok:
                n_slow += 1
            else:
                n_failed += 1
            fid = state_fault[b]
            if fid >= 0:
                bad_by_fault[fid] += 1
                last_bad[fid] = t
            per_minute[t // 60_000] += 1
        elif await_traffic[b] >= 0:
            fid = await_traffic[b]
            first_good[fid] = t - ended_at[fid]
            await_traffic[b] = -1
        if not enabled:
            if ok:
                lat_out.append(elapsed + lat)
            else:
                heappush(heap, (t + ms, seq, EV_DONE, p, name, ms, True, n, elapsed + lat, 0))
                seq += 1
            return
        duration = report_duration(config, ms, not ok)
        if pend and ms > signal_ms:
            # outstanding past the threshold: the signal reaches the table ``delay`` later
            # (before the send's completion report, which leaves after it)
            heappush(heap, (t + int(signal_ms) + delay, seq, EV_SIGNAL, p, name, int(signal_ms)))
            seq += 1
        if ok and duration == 0 and not (pend and ms > signal_ms):
            if per_producer:
                tb = tables[p]
                tb[name] = apply_report(tb.get(name), name, ms, 0, t, lrw)
            elif recover:
                table[name] = _apply(table.get(name), name, ms, False, "", t, t, config)
            elif pend:
                table[name] = papply(table.get(name), name, ms, False, str(p), t, t, config)
            else:
                table[name] = apply_report(table.get(name), name, ms, 0, t, lrw)
            lat_out.append(elapsed + lat)
            return
        heappush(heap, (t + ms, seq, EV_DONE, p, name, ms, not ok, n, elapsed + lat, duration))
        seq += 1

    def done(ev: tuple[Any, ...]) -> None:
        nonlocal n_exhausted
        t, _, _, p, name, ms, failed, n, elapsed, duration = ev
        if per_producer:
            tb = tables[p]
            tb[name] = apply_report(tb.get(name), name, ms, duration, t, lrw)
        elif shared:
            o = own[p]
            if o is None:
                o = own[p] = {}
            old = o.get(name) or table.get(name)
            o[name] = (_apply(old, name, ms, failed, "", t, t, config)
                       if recover else apply_report(old, name, ms, duration, t, lrw))
            arrivals.append((t + delay, p, name, ms, duration, failed))
        if not failed:
            lat_out.append(elapsed)
        elif n < retries and elapsed < deadline:
            attempt(p, t, name, n + 1, elapsed)
        else:
            n_exhausted += 1
            lat_out.append(elapsed)

    def arrive(a: tuple[int, int, str, int, int, bool]) -> None:
        t, p, name, ms, duration, failed = a
        if recover:
            item = _apply(table.get(name), name, ms, failed, "", t - delay, t, config)
            special.add(name)  # it may ramp up once its window ends
        elif pend:
            # the one rule: the report also withdraws its producer's signal
            item = papply(table.get(name), name, ms, failed, str(p), t, t, config)
        else:
            item = apply_report(table.get(name), name, ms, duration, t, lrw)
        table[name] = item
        o = own[p]
        if o is not None:
            mine = o.get(name)
            if mine is not None and mine.available_at <= item.available_at:
                del o[name]
                if not o:
                    own[p] = None

    def state_change(ev: tuple[Any, ...]) -> None:
        t, _, _, b, s, fid, arg = ev
        state[b] = s
        if fid >= 0:
            state_fault[b] = fid
            state_arg[b] = arg
        else:
            ended = arg
            state_fault[b] = -1
            ended_at[ended] = t
            await_traffic[b] = ended

    def detect(ev: tuple[Any, ...]) -> None:
        """The active detector's round: a crashed (or flapping, while down) broker refuses
        connections, any other accepts them; the readings reach the table ``delay`` later."""
        nonlocal seq
        t = ev[0]
        for nm, item in table.items():
            if t < item.available_at or policy.on_probation(item, t, config):
                heappush(heap, (t + delay, seq, EV_REACH, nm, state[index[nm]] != REFUSED, t))
                seq += 1
        heappush(heap, (t + config.detect_interval_ms, seq, EV_DETECT))
        seq += 1

    def reach(ev: tuple[Any, ...]) -> None:
        t, _, _, nm, reading, _read_at = ev
        item = table.get(nm)
        if item is not None:
            table[nm] = policy.reach(item, reading, t, config)
            if table[nm].probation:
                special.add(nm)

    def advance(t: float) -> None:
        """Handle every heap event and table arrival due at or before ``t``, in time order."""
        while heap or arrivals:
            ht = heap[0][0] if heap else math.inf
            qt = arrivals[0][0] if arrivals else math.inf
            if qt < ht:
                if qt > t:
                    return
                arrive(arrivals.popleft())
            else:
                if ht > t:
                    return
                ev = heappop(heap)
                if ev[2] == EV_DONE:
                    done(ev)
                elif ev[2] == EV_SIGNAL:
                    st, _, _, sp, sname, sms = ev
                    signal = ReportIn(sname, sms, False, 0, str(sp), pending=True)
                    e = apply_one(table.get(sname), signal, st, config)
                    if e.written and e.item is not None:
                        table[sname] = e.item
                elif ev[2] == EV_STATE:
                    state_change(ev)
                elif ev[2] == EV_DETECT:
                    if ev[0] < world.duration_s * 1000:
                        detect(ev)
                else:
                    reach(ev)

    periods = int(world.duration_s * 1000 // period)
    tick_every = max(1, 60_000 // period)
    for k in range(periods):
        base = k * period
        for j in range(producers):
            t = base + phase_of[j]
            if (heap and heap[0][0] <= t) or (arrivals and arrivals[0][0] <= t):
                advance(t)
            attempt(order[j], t, None, 0, 0.0)
        if tick is not None and (k + 1) % tick_every == 0:
            tick(tick_every * period // 1000)
    advance(math.inf)

    lat = np.frombuffer(lat_out, dtype=np.float32)
    kinds: dict[str, dict[str, float]] = {}
    per_fault: list[dict[str, Any]] = []
    for f in faults:
        per_fault.append({
            "id": f.id, "kind": f.kind, "broker": names[f.broker],
            "start_s": f.start_ms / 1000, "end_s": f.end_ms / 1000,
            "bad": bad_by_fault[f.id],
            "to_last_bad_s": None if last_bad[f.id] < 0 else (last_bad[f.id] - f.start_ms) / 1000,
            "to_traffic_s": None if first_good[f.id] < 0 else first_good[f.id] / 1000,
        })
    for kind in KINDS:
        fs = [x for x in per_fault if x["kind"] == kind]
        if not fs:
            continue
        bad = sum(x["bad"] for x in fs)
        lasts = [x["to_last_bad_s"] for x in fs if x["to_last_bad_s"] is not None]
        backs = [x["to_traffic_s"] for x in fs if x["to_traffic_s"] is not None]
        kinds[kind] = {
            "faults": len(fs), "bad": bad, "per_fault": bad / len(fs),
            "to_last_bad_s": float(np.median(lasts)) if lasts else math.nan,
            "to_traffic_s": float(np.median(backs)) if backs else math.nan,
        }
    return ArmResult(
        arm=arm.name, producers=producers, messages=int(lat.size), attempts=n_attempts,
        failed_attempts=n_failed, slow_attempts=n_slow, exhausted=n_exhausted,
        wall_s=round(time.perf_counter() - started, 2), kinds=kinds, faults=per_fault,
        latency_ms={
            "p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)),
            "p999": float(np.percentile(lat, 99.9)), "max": float(lat.max()),
        } if lat.size else {},
        cdf=[round(float(x), 6) for x in
             np.searchsorted(np.sort(lat), CDF_POINTS, side="right") / max(1, lat.size)],
        per_minute=per_minute,
    )


# -- output ----------------------------------------------------------------------------------


def ratios(results: Sequence[ArmResult], producers: int) -> dict[str, dict[str, float]]:
    """Per fault kind: per-producer bad attempts per fault divided by each Detour arm's."""
    at = {r.arm: r for r in results if r.producers == producers}
    base = at.get("per-producer")
    out: dict[str, dict[str, float]] = {}
    if base is None:
        return out
    for r in at.values():
        if not r.arm.startswith("detour"):
            continue
        per: dict[str, float] = {}
        for k, v in r.kinds.items():
            theirs = base.kinds[k]["per_fault"]
            # 0 / 0: no producer met the fault at all, nothing to compare
            per[k] = theirs / v["per_fault"] if v["per_fault"] else (
                math.inf if theirs else math.nan)
        out[r.arm] = per
    return out


def markdown(results: Sequence[ArmResult], world: World, command: str, wall_s: float) -> str:
    lines = [
        f"Simulated {world.duration_s:,} s, {world.brokers} brokers x {world.queues} queues, "
        f"{world.rate:g} msg/s per producer, send timeout {world.timeout_ms} ms, "
        f"seed {world.seed}; {len(schedule(world))} faults. Wall time {wall_s:.0f} s "
        f"(`{command}`).",
        "",
        "Bad attempts (failed, or >= 550 ms) per fault:",
        "",
        "| producers | strategy | crash | hang | slow | flapping | failed attempts | "
        "exhausted | p99 ms | wall s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        cells = [f"{r.kinds[k]['per_fault']:,.1f}" if k in r.kinds else "" for k in KINDS]
        lines.append(
            f"| {r.producers:,} | {r.arm} | {' | '.join(cells)} | {r.failed_attempts:,} | "
            f"{r.exhausted:,} | {r.latency_ms.get('p99', math.nan):,.1f} | {r.wall_s:.1f} |"
        )
    lines += ["", "Back in rotation: median s from a fault's end to its broker's first good send "
              "(restart to first send, for a crash):", "",
              "| producers | strategy | " + " | ".join(KINDS) + " |",
              "|---:|---|" + "---:|" * len(KINDS)]
    for r in results:
        lines.append(f"| {r.producers:,} | {r.arm} | " + " | ".join(
            f"{r.kinds[k]['to_traffic_s']:,.2f}" if k in r.kinds else "" for k in KINDS) + " |")
    for m in sorted({r.producers for r in results}):
        rs = ratios(results, m)
        if not rs:
            continue
        lines += ["", f"Ratio per-producer / Detour, bad attempts per fault, {m:,} producers:", "",
                  "| strategy | " + " | ".join(KINDS) + " |", "|---|" + "---:|" * len(KINDS)]
        for arm, per in rs.items():
            lines.append(f"| {arm} | " + " | ".join(
                f"{per[k]:,.1f}" if k in per and not math.isnan(per[k]) else "-"
                for k in KINDS) + " |")
    lines.append("")
    return "\n".join(lines)


ARM_STYLE: dict[str, tuple[str, str]] = {
    "no-avoidance": ("tab:gray", "o"),
    "per-producer": ("tab:red", "s"),
    "detour-1ms": ("tab:blue", "^"),
    "detour-100ms": ("tab:cyan", "v"),
    "detour-1s": ("tab:purple", "D"),
    "detour-recover-1ms": ("tab:green", "<"),
    "detour-recover-100ms": ("tab:olive", ">"),
    "detour-recover-1s": ("tab:brown", "P"),
    "detour-pending": ("tab:pink", "X"),
    "detour-all": ("black", "*"),
}


def plot_scaling(results: Sequence[ArmResult], path: Path, world: World) -> None:
    """Bad attempts per fault vs producers, one panel per fault kind, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(KINDS), figsize=(12, 3.4), sharey=True)
    for ax, kind in zip(axes, KINDS, strict=True):
        for name in dict.fromkeys(r.arm for r in results):
            rs = sorted((r for r in results if r.arm == name and kind in r.kinds),
                        key=lambda r: r.producers)
            if not rs:
                continue
            color, marker = ARM_STYLE.get(name, ("black", "x"))
            ax.plot([r.producers for r in rs], [r.kinds[kind]["per_fault"] for r in rs],
                    marker=marker, color=color, label=name, linewidth=1.5, markersize=4)
        ms = sorted({r.producers for r in results})
        ax.plot(ms, ms, color="black", linestyle=":", linewidth=1, label="= producers")
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1)
        ax.set_title(kind)
        ax.set_xlabel("producers")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("bad attempts per fault")
    axes[-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Simulated {world.duration_s:,} s, {world.brokers} brokers, {world.rate:g} msg/s "
                 "per producer: bad attempts (failed or >= 550 ms) per fault", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_cdf(results: Sequence[ArmResult], path: Path, producers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    for r in results:
        if r.producers != producers:
            continue
        color, _ = ARM_STYLE.get(r.arm, ("black", "x"))
        tail = [1 - c for c in r.cdf]
        ax.plot(CDF_POINTS, tail, label=r.arm, color=color, linewidth=1.3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(1e-7, 1.1)
    ax.set_xlabel("message send time, ms (all attempts)")
    ax.set_ylabel("fraction of messages slower")
    ax.set_title(f"Simulated, {producers:,} producers: latency tail (1 - CDF)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# -- CLI -------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _advance(bar: Any, producers: int, seconds: int) -> None:
    """The progress bar's tick: virtual seconds done, times the producers simulated."""
    bar.update(seconds * producers)


def _run_one(world: World, arm: Arm, producers: int) -> ArmResult:
    return simulate(world, arm, producers)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--producers", type=_ints, default=[1000],
                   help="comma list of producer counts (default 1000; 1,10,100,1000 to sweep)")
    p.add_argument("--brokers", type=int, default=100)
    p.add_argument("--queues", type=int, default=4, help="write queues per broker")
    p.add_argument("--duration", type=int, default=3600, help="virtual seconds (3600)")
    p.add_argument("--rate", type=float, default=1.0, help="messages/s per producer (1)")
    p.add_argument("--timeout-ms", type=int, default=1000, help="per-attempt send timeout")
    p.add_argument("--delays", type=_ints, default=[1, 100, 1000],
                   help="Detour report propagation delays, ms (1,100,1000)")
    p.add_argument("--strategies", default="",
                   help="comma list of strategy names to run (default: all)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1, help="processes (default 1)")
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--img", type=Path, default=None,
                   help="write the plots here too (e.g. docs/img)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.duration < 60 or args.brokers < 2 or min(args.producers) < 1:
        p.error("--duration >= 60, --brokers >= 2, --producers >= 1")
    world = World(brokers=args.brokers, queues=args.queues, duration_s=args.duration,
                  rate=args.rate, timeout_ms=args.timeout_ms, seed=args.seed)
    chosen = arms(args.delays)
    if args.strategies:
        want = set(args.strategies.split(","))
        chosen = [a for a in chosen if a.name in want]
        if not chosen:
            p.error(f"no such strategy; known: {[a.name for a in arms(args.delays)]}")
    command = "python -m bench.simulate " + " ".join(
        argv if argv is not None else sys.argv[1:])
    jobs = [(arm, m) for m in args.producers for arm in chosen]
    show = not args.no_progress and sys.stderr.isatty()
    started = time.perf_counter()
    results: list[ArmResult] = []
    from tqdm import tqdm

    bar = tqdm(total=sum(m * args.duration for _, m in jobs), unit="msg", unit_scale=True,
               disable=not show, file=sys.stderr, desc="simulate")
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(_run_one, world, arm, m) for arm, m in jobs]
            for (_, m), fut in zip(jobs, futures, strict=True):
                results.append(fut.result())
                bar.update(m * args.duration)
    else:
        for arm, m in jobs:
            bar.set_postfix_str(f"{arm.name} x{m}")
            results.append(simulate(world, arm, m, tick=functools.partial(_advance, bar, m)))
    bar.close()
    wall = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    md = markdown(results, world, command.strip(), wall)
    (args.out / "simulate.json").write_text(json.dumps({
        "world": asdict(world), "command": command.strip(), "wall_s": round(wall, 1),
        "machine": {"nproc": os.cpu_count(), "python": platform.python_version()},
        "faults": [asdict(f) for f in schedule(world)], "cdf_points": CDF_POINTS,
        "results": [asdict(r) for r in results],
    }, indent=1))
    (args.out / "simulate.md").write_text(md)
    dirs = [args.out] + ([args.img] if args.img else [])
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        if len({r.producers for r in results}) > 1:
            plot_scaling(results, d / "sim-scaling.png", world)
        plot_cdf(results, d / "sim-latency-cdf.png", max(args.producers))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
