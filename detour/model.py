"""Value objects shared by the fault strategy, the stores and the API: immutable, no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

#: The longest latency accepted, ms: an hour. Anything above is a clock bug, not a send.
MAX_LATENCY_MS = 3_600_000
#: The longest avoidance window a config may set, ms: a day.
MAX_WINDOW_MS = 86_400_000
#: The oldest a replayed report may be: older ones cannot open a window that is still open.
MAX_REPORT_AGE_MS = MAX_WINDOW_MS
#: How long, and how many per scope, a store remembers report ids (an SDK replays within
#: minutes, a retried batch within seconds): a report id seen within them is a duplicate.
REPORT_ID_WINDOW_MS = 15 * 60 * 1000
REPORT_ID_CAP = 100_000
#: A report with an id, dated within this of what its scope's id memory may have forgotten
#: (older than the window, or no newer than the newest id the cap pushed out), may be the
#: replay of a forgotten one: it is answered ``expired`` and not applied, never applied
#: twice. The slack covers a replay's dating: its age is read against the replica's clock
#: when it is accepted, so a replay that took longer to arrive than the first send dates
#: later. Small, because a scope that pushes ids out faster than one per this much over the
#: cap (100,000 / 5 s = 20,000 reports a second, ten replicas' worth) would find its fresh
#: reports dated inside it. A producer gives up a report older than the window less a
#: minute (the SDK, detour/client/pending.py).
REPORT_ID_MARGIN_MS = 5_000
#: Lower bounds (ms) of the latency log's histogram buckets: a replica sums the reports that
#: change no window into one histogram per broker per flush (docs/semantics.md). Fixed, so
#: histograms of every replica and interval add up; they hold RocketMQ's tier edges (50,
#: 100, 550, 1000, 2000, 3000, 15000) so a tier's count is exact, and finer steps below
#: 1 s where the analysis reads q50 and q99. The last bucket is open above 60 s.
LATENCY_BUCKETS: tuple[int, ...] = (
    0,
    5,
    10,
    15,
    20,
    25,
    30,
    35,
    40,
    45,
    50,
    60,
    70,
    80,
    90,
    100,
    120,
    140,
    160,
    180,
    200,
    250,
    300,
    350,
    400,
    450,
    500,
    550,
    600,
    700,
    800,
    900,
    1000,
    1250,
    1500,
    1750,
    2000,
    2500,
    3000,
    4000,
    5000,
    7500,
    10000,
    15000,
    20000,
    30000,
    60000,
)

#: RocketMQ's MQFaultStrategy defaults (client 4.x, unchanged in 5.x).
DEFAULT_LATENCY_MAX: tuple[int, ...] = (50, 100, 550, 1000, 2000, 3000, 15000)
DEFAULT_NOT_AVAILABLE_DURATION: tuple[int, ...] = (0, 0, 30000, 60000, 120000, 180000, 600000)

#: How a select chooses among available queues (docs/policy.md).
SELECTIONS = ("round_robin", "p2c-ewma")
#: What a keyed (ordered) select does when the key's queue is on an avoided broker.
ORDERED_FALLBACKS = ("wait", "remap")
#: Most distinct producers a quorum may ask for.
MAX_QUORUM = 64
#: Most latency tiers a config may have.
MAX_TIERS = 32


@dataclass(frozen=True, slots=True)
class ConfigField:
    """One Config field's rules and words, so every other mapping of Config is derived.

    The API schema (service/schemas.py), the camelCase bodies and the stored config
    (``Config.to_wire``/``Config.from_wire``, used by the API, service/store/codec.py and
    the SDK) read these instead of naming the fields again. ``name``, ``wire`` and
    ``default`` are filled in from the dataclass field (see ``CONFIG_FIELDS``).
    """

    #: What the field does, for operators (the OpenAPI description).
    description: str
    #: Inclusive bounds of an int field, or of every entry of a tuple field.
    ge: int | None = None
    le: int | None = None
    #: The values a str field may take.
    choices: tuple[str, ...] = ()
    #: A tuple field holds 1..max_items entries.
    max_items: int = 0
    name: str = ""
    #: The field's name in JSON bodies and in the stored config.
    wire: str = ""
    default: Any = None

    @property
    def kind(self) -> type:
        """bool, int, str or tuple (of ints): what the default is."""
        return type(self.default)

    def check(self, value: Any) -> None:
        """Raises ValueError when ``value`` is outside this field's rules."""
        if self.kind is tuple:
            if not 1 <= len(value) <= self.max_items:
                raise ValueError(f"{self.name} needs 1..{self.max_items} entries")
            entries = value
        else:
            entries = (value,)
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.name} must be one of {self.choices}")
        for v in entries:
            if (self.ge is not None and v < self.ge) or (self.le is not None and v > self.le):
                raise ValueError(f"{self.name} must be {self.ge}..{self.le}")


#: The key of a Config field's ConfigField in its dataclass metadata.
_RULES = "detour"


def _field(default: Any, description: str, **rules: Any) -> Any:
    return field(default=default, metadata={_RULES: ConfigField(description, **rules)})


@dataclass(frozen=True, slots=True)
class Config:
    """One deployment's fault-strategy settings; every replica uses the same one.

    Declared once, here: each field's bounds and description come with it, and the
    API schema, the JSON and Redis encodings and the SDK's decoding derive from it.
    """

    send_latency_fault_enable: bool = _field(
        True,
        "Avoid brokers by reported latency. Off: plain round-robin, reports change no window.",
    )
    latency_max: tuple[int, ...] = _field(
        DEFAULT_LATENCY_MAX,
        "Latency tiers in ms, strictly increasing, 0..3600000.",
        ge=0,
        le=MAX_LATENCY_MS,
        max_items=MAX_TIERS,
    )
    not_available_duration: tuple[int, ...] = _field(
        DEFAULT_NOT_AVAILABLE_DURATION,
        "Window length in ms for each tier of latencyMax (same length), 0..86400000.",
        ge=0,
        le=MAX_WINDOW_MS,
        max_items=MAX_TIERS,
    )
    isolation_latency_ms: int = _field(
        30000, "The latency a failure (`isolation: true`) counts as.", ge=0, le=MAX_LATENCY_MS
    )
    last_report_wins: bool = _field(
        False,
        "RocketMQ 4.x rule: every report overwrites the window, so a fast success ends an "
        "isolation. Off (default): a report only ever extends a window.",
    )
    # -- policy beyond RocketMQ (docs/policy.md); the defaults are RocketMQ's behaviour --
    selection: str = _field(
        "round_robin",
        "How a select chooses among available queues: `round_robin` (RocketMQ) or "
        "`p2c-ewma` (two queues at random, the broker with the lower peak-EWMA latency wins).",
        choices=SELECTIONS,
    )
    ordered_fallback: str = _field(
        "wait",
        "A select with `shardingKey` whose queue is on an avoided broker: `wait` returns it "
        "anyway (order kept), `remap` returns the next queue on an available broker (order "
        "kept only while the avoided set is stable).",
        choices=ORDERED_FALLBACKS,
    )
    # Envoy's max_ejection_percent.
    max_avoided_percent: int = _field(
        100,
        "Never avoid more than this share of a route's brokers at once; beyond it the least "
        "bad (pickOneAtLeast's order) are served. 100 = no limit (RocketMQ).",
        ge=0,
        le=100,
    )
    # Envoy's panic threshold.
    panic_threshold_percent: int = _field(
        0,
        "When fewer than this share of a route's brokers are available, ignore avoidance and "
        "spread over all (`panic: true` in the select). 0 = off.",
        ge=0,
        le=100,
    )
    enforcement_percent: int = _field(
        100,
        "Share of selects that obey open windows; the others only count them (`dryRun: "
        "true`). 100 = always enforce.",
        ge=0,
        le=100,
    )
    isolation_quorum: int = _field(
        1,
        "Distinct producers whose failures (not `origin: broker`) it takes, within "
        "`quorumWindowMs`, to isolate a broker for everyone; below it only the reporters "
        "avoid it. 1 = every failure isolates (RocketMQ).",
        ge=1,
        le=MAX_QUORUM,
    )
    quorum_window_ms: int = _field(
        60000,
        "How recent a failure (or a slow answer, for `latencyQuorum`) must be to count toward "
        "the quorum (ms).",
        ge=1,
        le=MAX_WINDOW_MS,
    )
    latency_quorum: int = _field(
        1,
        "Distinct producers whose slow answers (a latency tier with a window, not `origin: "
        "broker`) it takes, within `quorumWindowMs`, to open that window for everyone; below "
        "it only the reporters avoid the broker, as with RocketMQ's per-producer table. 1 = "
        "every slow answer opens it for all (RocketMQ with one table).",
        ge=1,
        le=MAX_QUORUM,
    )
    # Envoy's and gRPC's ejection backoff.
    repeat_multiplier: bool = _field(
        False,
        "Multiply a failure's window by the broker's recent isolation count (capped by "
        "`maxIsolationMs`, decaying by one per `repeatDecayMs` healthy).",
    )
    # Envoy's max_ejection_time.
    max_isolation_ms: int = _field(
        3_600_000,
        "Cap on a multiplied isolation window (ms); never below the tier's own.",
        ge=1,
        le=MAX_WINDOW_MS,
    )
    repeat_decay_ms: int = _field(
        600000,
        "A broker's isolation count drops by one per this many ms it was healthy.",
        ge=1,
        le=MAX_WINDOW_MS,
    )
    jitter_percent: int = _field(
        0,
        "Lengthen each isolation window by a random 0..jitterPercent % so windows opened "
        "together do not end together. 0 = off.",
        ge=0,
        le=100,
    )
    probe_on_expiry: bool = _field(
        False,
        "When a window ends, give the broker to one select (the probe, `probe: true`) and "
        "keep the rest away until a successful report for it; a failure re-isolates it (with "
        "backoff when `repeatMultiplier` is on).",
    )
    probe_timeout_ms: int = _field(
        10000,
        "A probe not reported within this many ms is given to another select.",
        ge=1,
        le=MAX_WINDOW_MS,
    )
    # RocketMQ 5's startDetectorEnable and detectInterval.
    detector_enable: bool = _field(
        False,
        "Active detector (RocketMQ 5's startDetectorEnable): one replica at a time "
        "TCP-connects to avoided brokers that have an address and records whether they "
        "answer (`reachable` in `/fault-items`); pickOneAtLeast prefers reachable ones.",
    )
    detect_interval_ms: int = _field(2000, "ms between two detector rounds.", ge=100, le=3_600_000)
    detect_timeout_ms: int = _field(
        200,
        "ms a detector connect may take before the broker counts as unreachable.",
        ge=1,
        le=60_000,
    )
    # -- recovery (docs/policy.md, "Staggered return" and "Early recovery") --
    ramp_ms: int = _field(
        0,
        "Staggered return: for this many ms after a window ends the broker gets a growing "
        "share of the selects that could pick it (1/64, doubling every rampMs/6); the others "
        "skip it as an avoided broker. 0 = off (every select at once, RocketMQ).",
        ge=0,
        le=MAX_WINDOW_MS,
    )
    early_recovery: bool = _field(
        False,
        "Early recovery: a broker in an open window that the active detector found refusing "
        "connections and then reachable again is put on probation at once (probe sends, as "
        "with `probeOnExpiry`); a probe's success returns it to all before its window ends, a "
        "failure re-isolates it (with backoff when `repeatMultiplier` is on, and a broker "
        "isolated again within `repeatDecayMs`, e.g. a flapping one, waits out its window). "
        "Needs `detectorEnable`.",
    )
    # -- in-flight signals (docs/policy.md, "Pending sends") --
    pending_quorum: int = _field(
        0,
        "Distinct producers with a send still outstanding (`pending: true` reports, not "
        "withdrawn by a completed send, within `quorumWindowMs`) it takes to avoid the broker "
        "for everyone before any timeout fires. 0 = off: pending reports change nothing.",
        ge=0,
        le=MAX_QUORUM,
    )

    def __post_init__(self) -> None:
        # The API validates with the same rules (derived); this guards programmatic callers.
        for f in CONFIG_FIELDS:
            f.check(getattr(self, f.name))
        if len(self.not_available_duration) != len(self.latency_max):
            raise ValueError("latency_max and not_available_duration need the same length")
        if any(b <= a for a, b in zip(self.latency_max, self.latency_max[1:], strict=False)):
            raise ValueError("latency_max must be strictly increasing")

    def to_wire(self) -> dict[str, Any]:
        """The camelCase body of ``GET /config``, also what the stores keep (JSON values)."""
        return {
            f.wire: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in CONFIG_FIELDS
        }

    @classmethod
    def from_wire(cls, body: Mapping[str, Any], *, lenient: bool = False) -> Config:
        """A Config from a camelCase body; omitted fields take their defaults, unknown keys
        are ignored (a pushed config carries its version beside it). Raises ValueError when a
        value breaks the rules; ``lenient``: a field that breaks its own rules takes its
        default instead (a client reading a newer service's config)."""
        values: dict[str, Any] = {}
        for f in CONFIG_FIELDS:
            if f.wire not in body:
                continue
            raw = body[f.wire]
            try:
                value = tuple(int(x) for x in raw) if f.kind is tuple else f.kind(raw)
                if lenient:
                    f.check(value)
            except (TypeError, ValueError):
                if not lenient:
                    raise
                continue
            values[f.name] = value
        return cls(**values)


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part.capitalize() for part in rest)


#: Every Config field with its rules, in declaration order (the order of the API schema).
CONFIG_FIELDS: tuple[ConfigField, ...] = tuple(
    replace(f.metadata[_RULES], name=f.name, wire=_camel(f.name), default=f.default)
    for f in fields(Config)
)


@dataclass(frozen=True, slots=True)
class Queue:
    """One message queue of a topic: RocketMQ's MessageQueue without the topic."""

    broker_name: str
    queue_id: int


@dataclass(frozen=True, slots=True)
class BrokerRoute:
    """A broker's part of a registered route, as an operator declares it."""

    broker_name: str
    write_queue_nums: int
    address: str | None = None


@dataclass(frozen=True, slots=True)
class Why:
    """Why a broker's window is open: the report that set its end.

    ``reason`` is the event log's word for what set it (detour.policy.events): ``isolation``
    (a failed send), ``latency`` (a slow answer's tier, also when slow answers of enough
    producers reached latencyQuorum), ``quorum`` (failures of enough producers reached
    isolationQuorum), ``pending`` (in-flight signals of enough producers: a hang) or
    ``probe`` (a probation probe failed). A merge keeps it with the window end it explains
    (detour.merge).
    """

    reason: str
    #: when the report's send completed (epoch ms, the store's clock): since when
    since: int
    #: the latency the report measured (ms): with the config's tiers, the window's tier
    latency_ms: int
    #: who set it: the producer (the token's name when tokens are on); "" when unnamed
    by: str = ""


@dataclass(frozen=True, slots=True)
class FaultItem:
    """A broker's entry in the fault table (RocketMQ's FaultItem).

    ``available_at`` is the end of the avoidance window in epoch ms; RocketMQ
    calls it ``startTimestamp`` (the time the broker becomes usable again).
    """

    broker_name: str
    current_latency_ms: int
    available_at: int
    #: recent isolations (the backoff multiplier's count), 0 unless repeatMultiplier is on
    isolations: int = 0
    #: producers whose failure is short of the isolation quorum, with when each failed (ms);
    #: each avoids the broker on its own until its failure's window would have ended
    suspects: tuple[tuple[str, int], ...] = ()
    #: on probation (probeOnExpiry): once the window ends, only a probe is sent until a
    #: successful report re-opens the broker to all
    probation: bool = False
    #: the active detector's last reading: True (a TCP connect succeeded), False (refused or
    #: timed out), None (never checked); pickOneAtLeast prefers reachable brokers
    reachable: bool | None = None
    #: producers whose slow answers are short of the latency quorum: (producer, when it
    #: answered slowly (ms), the end of its own window (ms)); each avoids the broker alone
    #: until its window ends
    slow: tuple[tuple[str, int, int], ...] = ()
    #: in-flight signals (pendingQuorum): (producer, when its outstanding send started (ms),
    #: when it last signalled (ms)); signalled 0: withdrawn, the producer's last completed
    #: send at the second value, so a signal arriving late for an earlier send is ignored
    pending: tuple[tuple[str, int, int], ...] = ()
    #: why the window is open (the report that set its end); None when no window is open
    why: Why | None = None
    #: the stamp of the write that stored this item (0: never stored in a shared table): it
    #: orders copies of the item in a merge (detour.merge) and is no part of what it says
    stamp: int = field(default=0, compare=False)

    def is_available(self, now_ms: int) -> bool:
        return now_ms >= self.available_at


@dataclass(frozen=True)
class Route:
    """A topic's queues in selection order: by broker name, then queue id.

    Derived lookups are computed once here because ``select`` runs on every
    request and must not rebuild them.
    """

    topic: str
    queues: tuple[Queue, ...]
    addresses: Mapping[str, str | None]
    by_broker: Mapping[str, tuple[Queue, ...]] = field(init=False, repr=False, compare=False)
    #: run_end[i]: index one past the last queue of queues[i]'s broker run.
    run_end: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        grouped: dict[str, list[Queue]] = {}
        for q in self.queues:
            grouped.setdefault(q.broker_name, []).append(q)
        run_end: list[int] = [0] * len(self.queues)
        i = 0
        while i < len(self.queues):
            j = i
            while j < len(self.queues) and self.queues[j].broker_name == self.queues[i].broker_name:
                j += 1
            for k in range(i, j):
                run_end[k] = j
            i = j
        object.__setattr__(
            self, "by_broker", MappingProxyType({b: tuple(qs) for b, qs in grouped.items()})
        )
        object.__setattr__(self, "run_end", tuple(run_end))

    @classmethod
    def from_brokers(cls, topic: str, brokers: Iterable[BrokerRoute]) -> Route:
        ordered = sorted(brokers, key=lambda b: b.broker_name)
        queues = tuple(
            Queue(b.broker_name, qid) for b in ordered for qid in range(b.write_queue_nums)
        )
        return cls(topic, queues, MappingProxyType({b.broker_name: b.address for b in ordered}))

    @classmethod
    def from_queues(cls, topic: str, queues: Iterable[Queue]) -> Route:
        """An ad-hoc route from a select's inline queue list (no addresses)."""
        ordered = tuple(sorted(set(queues), key=lambda q: (q.broker_name, q.queue_id)))
        return cls(topic, ordered, MappingProxyType({q.broker_name: None for q in ordered}))


def route_brokers(route: Route) -> tuple[BrokerRoute, ...]:
    """A registered route's brokers back from its queue list."""
    return tuple(
        BrokerRoute(b, len(qs), route.addresses.get(b)) for b, qs in route.by_broker.items()
    )
