"""Decision vectors: cases of the one select (``detour.decide``) written out as JSON.

    make vectors                                          # rewrites docs/vectors/select.json
    PYTHONPATH=. .venv/bin/python docs/vectors/generate.py --check   # exit 1 when stale

It lives beside the file it writes, not in a package: nothing at run time reads it.

Each case is a table (config, route, fault items, the topic's counter, ``now``, p2c
scores, free probes), a request and the random draws, with the decision the pure core
makes. The service and the SDK are tested against the file (tests/test_vectors.py), and
a producer SDK in another language can be: docs/clients.md explains the format. The
cases are named hand-picked ones (each policy rule, the rows of issue 16's table) and
seeded random ones; the same seed always writes the same file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from detour.decide import Ask, Table, answer, decide, draw
from detour.model import CONFIG_FIELDS, BrokerRoute, Config, FaultItem, Route, route_brokers
from detour.policy import Draws, on_probation

#: Where the corpus lives, relative to the repository root.
PATH = Path(__file__).resolve().parent / "select.json"
#: Bump when the format changes (a reader checks it).
FORMAT = 1
#: Random cases in the corpus, and the seed that draws them.
RANDOM_CASES = 250
SEED = 16
#: Every case's ``now`` (epoch ms): fixed, so the file does not change from run to run.
NOW = 1_764_000_000_000
TOPIC = "orders"


# ---------------------------------------------------------------- JSON <-> values


def fault_json(item: FaultItem) -> dict[str, Any]:
    """A fault item as the push stream sends it (service/api/render.py ``fault_event``)."""
    return {
        "brokerName": item.broker_name,
        "currentLatencyMs": item.current_latency_ms,
        "availableAt": item.available_at,
        "isolations": item.isolations,
        "suspects": [[who, at] for who, at in item.suspects],
        "slow": [[who, at, end] for who, at, end in item.slow],
        "probation": item.probation,
        "reachable": item.reachable,
    }


def route_json(route: Route) -> dict[str, Any]:
    """A route as ``GET /routes/{topic}`` and the push stream send it."""
    return {
        "topic": route.topic,
        "brokers": [
            {
                "brokerName": b.broker_name,
                "writeQueueNums": b.write_queue_nums,
                "address": b.address,
            }
            for b in route_brokers(route)
        ],
    }


def case_json(
    name: str, table: Table, ask: Ask, draws: Draws, expect: dict[str, Any]
) -> dict[str, Any]:
    return {
        "name": name,
        "config": table.config.to_wire(),
        "route": route_json(table.route),
        "faults": [fault_json(table.faults[b]) for b in sorted(table.faults)],
        "counter": table.counter,
        "now": table.now_ms,
        "scores": {b: table.scores[b] for b in sorted(table.scores)},
        "probes": sorted(table.probes),
        "request": {
            "topic": table.route.topic,
            "lastBrokerName": ask.last_broker,
            "producer": ask.producer,
            "shardingKey": ask.sharding_key,
        },
        "draws": {
            "enforce": draws.enforce,
            "p2cFirst": draws.p2c_first,
            "p2cSecond": draws.p2c_second,
            "ramp": draws.ramp,
        },
        "expect": expect,
    }


# ---------------------------------------------------------------- the cases


def _route(*brokers: tuple[str, int]) -> Route:
    return Route.from_brokers(
        TOPIC, [BrokerRoute(b, n, f"10.0.0.{i + 1}:10911") for i, (b, n) in enumerate(brokers)]
    )


_ABCD = _route(("broker-a", 4), ("broker-b", 4), ("broker-c", 4), ("broker-d", 4))


def _isolated(broker: str, **kw: Any) -> FaultItem:
    return FaultItem(broker, 30000, NOW + 600_000, **kw)


def _named() -> Iterator[tuple[str, Table, Ask, Draws]]:
    """Hand-picked cases: the defaults, each policy rule, the rows of issue 16's table."""
    t = Table(_ABCD, Config(), {}, 7, NOW)
    yield "defaults, nothing avoided: round-robin from the counter", t, Ask(), Draws()
    yield "defaults, retry skips the last broker", t, Ask("broker-b"), Draws()
    one = {"broker-a": _isolated("broker-a")}
    yield (
        "defaults, an isolated broker is walked over",
        Table(_ABCD, Config(), one, 0, NOW),
        Ask(),
        Draws(),
    )
    every = {
        b: FaultItem(b, 100 * i + 600, NOW + 30_000 * (i + 1))
        for i, b in enumerate(sorted(_ABCD.by_broker))
    }
    for counter in (0, 1, 2, 5):
        yield (
            f"defaults, every broker avoided: pickOneAtLeast, counter {counter}",
            Table(_ABCD, Config(), every, counter, NOW),
            Ask(),
            Draws(),
        )
    off = Config(send_latency_fault_enable=False)
    yield (
        "avoidance off: round-robin past the last broker",
        Table(_ABCD, off, one, 3, NOW),
        Ask("broker-a"),
        Draws(),
    )
    # issue 16, row 1: maxAvoidedPercent=50, a and b isolated, d slow
    row1 = {
        "broker-a": _isolated("broker-a"),
        "broker-b": _isolated("broker-b"),
        "broker-d": FaultItem("broker-d", 600, NOW + 30_000),
    }
    for counter in (0, 4, 8, 12):
        yield (
            f"maxAvoidedPercent 50: the least bad of three avoided is served, counter {counter}",
            Table(_ABCD, Config(max_avoided_percent=50), row1, counter, NOW),
            Ask(),
            Draws(),
        )
    # row 2: panicThresholdPercent=50, a, b and c isolated
    row2 = {b: _isolated(b) for b in ("broker-a", "broker-b", "broker-c")}
    for counter in (0, 5, 9):
        yield (
            f"panicThresholdPercent 50: three of four avoided, panic, counter {counter}",
            Table(_ABCD, Config(panic_threshold_percent=50), row2, counter, NOW),
            Ask(),
            Draws(),
        )
    # row 3: isolationQuorum=2, p1 failed on a (short of the quorum)
    row3 = {"broker-a": FaultItem("broker-a", 30000, NOW - 1, suspects=(("p1", NOW - 500),))}
    quorum = Config(isolation_quorum=2)
    for producer in ("p1", "p2", None):
        yield (
            f"isolationQuorum 2: a failure of p1 on a, asked by {producer}",
            Table(_ABCD, quorum, row3, 0, NOW),
            Ask(producer=producer),
            Draws(),
        )
    # latencyQuorum=2: p1's cold first send to d took 795 ms (the 550 ms tier, 30 s), short
    # of the quorum: p1 keeps away from d, the others do not
    cold = {
        "broker-d": FaultItem("broker-d", 795, NOW - 500, slow=(("p1", NOW - 500, NOW + 29_500),))
    }
    for producer in ("p1", "p2", None):
        yield (
            f"latencyQuorum 2: a slow answer of p1 on d, asked by {producer}",
            Table(_ABCD, Config(latency_quorum=2), cold, 3, NOW),
            Ask(producer=producer),
            Draws(),
        )
    yield (
        "latencyQuorum 2: p1's own window on d has ended",
        Table(_ABCD, Config(latency_quorum=2), cold, 3, NOW + 30_000),
        Ask(producer="p1"),
        Draws(),
    )
    # row 4: maxAvoidedPercent=0, a isolated
    for counter in (0, 4):
        yield (
            f"maxAvoidedPercent 0: nothing is avoided, counter {counter}",
            Table(_ABCD, Config(max_avoided_percent=0), one, counter, NOW),
            Ask(),
            Draws(),
        )
    dry = Config(enforcement_percent=50)
    for roll in (0.2, 0.7):
        yield (
            f"enforcementPercent 50, roll {roll}",
            Table(_ABCD, dry, one, 0, NOW),
            Ask(),
            Draws(roll),
        )
    for key in ("order-42", "order-7", "customer-19"):
        for fallback in ("wait", "remap"):
            yield (
                f"shardingKey {key}, orderedFallback {fallback}, a and b isolated",
                Table(_ABCD, Config(ordered_fallback=fallback), row2 | one, 3, NOW),
                Ask(sharding_key=key),
                Draws(),
            )
    p2c = Config(selection="p2c-ewma")
    scores = {"broker-a": 5.0, "broker-b": 80.0, "broker-c": 12.5, "broker-d": 40.0}
    for r1, r2 in ((0, 0), (3, 9), (11, 2), (7, 7)):
        yield (
            f"p2c-ewma, draws {r1} and {r2}",
            Table(_ABCD, p2c, one, 0, NOW, scores),
            Ask(),
            Draws(0.0, r1, r2),
        )
    probation = {"broker-c": FaultItem("broker-c", 30000, NOW - 10, probation=True)}
    probe = Config(probe_on_expiry=True)
    yield (
        "probeOnExpiry: the free probe goes first",
        Table(_ABCD, probe, probation, 1, NOW, {}, ("broker-c",)),
        Ask(),
        Draws(),
    )
    yield (
        "probeOnExpiry: the probe already handed out",
        Table(_ABCD, probe, probation, 1, NOW),
        Ask(),
        Draws(),
    )
    reach = {
        "broker-a": FaultItem("broker-a", 100, NOW + 30_000, reachable=False),
        "broker-b": FaultItem("broker-b", 900, NOW + 60_000, reachable=True),
        "broker-c": FaultItem("broker-c", 900, NOW + 60_000),
        "broker-d": FaultItem("broker-d", 900, NOW + 60_000),
    }
    yield (
        "detector: pickOneAtLeast prefers reachable brokers",
        Table(_ABCD, Config(detector_enable=True), reach, 0, NOW),
        Ask(),
        Draws(),
    )
    ramp = Config(ramp_ms=3000)
    for ago, roll in ((250, 0.01), (250, 0.5), (1600, 0.1), (1600, 0.2), (3000, 0.99)):
        yield (
            f"rampMs 3000: window ended {ago} ms ago, ramp roll {roll}",
            Table(_ABCD, ramp, {"broker-c": FaultItem("broker-c", 3, NOW - ago)}, 9, NOW),
            Ask(),
            Draws(ramp=roll),
        )
    early = {"broker-b": FaultItem("broker-b", 30000, NOW - 5, probation=True, reachable=True)}
    yield (
        "earlyRecovery: the detector found the broker back, the free probe goes first",
        Table(
            _ABCD,
            Config(early_recovery=True, detector_enable=True),
            early,
            0,
            NOW,
            {},
            ("broker-b",),
        ),
        Ask(),
        Draws(),
    )


_BROKERS = tuple(f"broker-{c}" for c in "abcdefgh")
_PRODUCERS = ("p1", "p2", "p3")
#: Window lengths (ms) of the default tiers a slow answer can open.
_SLOW = (30_000, 60_000, 120_000)


def _random_config(rng: random.Random) -> Config:
    values: dict[str, Any] = {}
    for f in CONFIG_FIELDS:
        if rng.random() < 0.6 or f.kind is tuple:
            continue  # most fields at their default, the tiers always
        if f.kind is bool:
            values[f.name] = rng.random() < 0.5
        elif f.choices:
            values[f.name] = rng.choice(f.choices)
        elif f.name.endswith("_percent"):
            values[f.name] = rng.choice((0, 25, 50, 75, 100))
        elif f.name in ("isolation_quorum", "latency_quorum"):
            values[f.name] = rng.randint(1, 3)
        elif f.ge is not None and f.le is not None:
            values[f.name] = rng.randint(f.ge, min(f.le, 100_000))
    return Config(**values)


def random_table(rng: random.Random) -> tuple[Table, Ask, Draws]:
    """One random table and request, drawn from ``rng`` (the differential test's too)."""
    config = _random_config(rng)
    brokers = rng.sample(_BROKERS, rng.randint(1, 6))
    route = Route.from_brokers(
        TOPIC,
        [
            BrokerRoute(b, rng.randint(1, 4), rng.choice((None, f"10.1.0.{i}:10911")))
            for i, b in enumerate(brokers)
        ],
    )
    faults: dict[str, FaultItem] = {}
    for b in [*brokers, rng.choice(_BROKERS)]:
        if rng.random() < 0.5:
            continue
        suspects = tuple(
            sorted(
                (p, NOW - rng.randint(0, 700_000))
                for p in rng.sample(_PRODUCERS, rng.randint(0, 2))
            )
        )
        faults[b] = FaultItem(
            b,
            rng.choice((0, 60, 120, 600, 1500, 30000)),
            NOW + rng.choice((-600_000, -5_000, -1, 0, 1, 30_000, 600_000)),
            rng.randint(0, 3),
            suspects,
            rng.random() < 0.3,
            rng.choice((None, True, False)),
            tuple(
                sorted(
                    (p, NOW - (ago := rng.randint(0, 70_000)), NOW - ago + rng.choice(_SLOW))
                    for p in rng.sample(_PRODUCERS, rng.randint(0, 2))
                )
            ),
        )
    # What a decider sees: the table's latency for every fault item, its own peak EWMA
    # where it has one (detour/view.py ``latency_scores``).
    scores = {b: float(i.current_latency_ms) for b, i in faults.items()}
    scores.update({b: float(rng.randint(0, 400)) for b in brokers if rng.random() < 0.8})
    probes = tuple(
        b
        for b in brokers
        if b in faults and on_probation(faults[b], NOW, config) and rng.random() < 0.8
    )
    table = Table(route, config, faults, rng.randrange(1 << 16), NOW, scores, probes)
    ask = Ask(
        rng.choice((None, None, *brokers)),
        rng.choice((None, *_PRODUCERS)),
        rng.choice((None, None, None, "order-42", f"key-{rng.randrange(1000)}")),
    )
    return table, ask, draw(config, rng)


def cases(count: int = RANDOM_CASES, seed: int = SEED) -> list[dict[str, Any]]:
    """Every case, named then random, with the decision ``detour.decide`` makes."""
    out = [case_json(n, t, a, d, answer(decide(t, a, d))) for n, t, a, d in _named()]
    rng = random.Random(seed)
    for i in range(count):
        t, a, d = random_table(rng)
        out.append(case_json(f"random {i}", t, a, d, answer(decide(t, a, d))))
    return out


def corpus() -> dict[str, Any]:
    return {
        "format": FORMAT,
        "about": "Detour's select decisions: table + request + draws -> decision. "
        "Written by `make vectors` (docs/vectors/generate.py); docs/clients.md explains the format.",
        "cases": cases(),
    }


def render() -> str:
    """The corpus as JSON text, one case a line (a changed decision is a one-line diff)."""
    c = corpus()
    head = json.dumps({k: v for k, v in c.items() if k != "cases"})[:-1]
    lines = ",\n".join(json.dumps(case, separators=(",", ":")) for case in c["cases"])
    return f'{head}, "cases": [\n{lines}\n]}}\n'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    parser.add_argument("--out", type=Path, default=PATH)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run make vectors", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"{args.out}: {text.count(chr(10)) - 2} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
