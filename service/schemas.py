"""Request and response bodies: the components of openapi.yaml, validated at the edge."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    create_model,
    field_validator,
)
from pydantic.alias_generators import to_camel

from detour.model import CONFIG_FIELDS, MAX_LATENCY_MS, MAX_REPORT_AGE_MS, ConfigField

#: RocketMQ's topic rule (letters, digits, ``_ - % |``) plus ``.``, at most 127 characters.
NAME_PATTERN = r"^[A-Za-z0-9_.%|-]{1,127}$"

BrokerName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=127,
        pattern=NAME_PATTERN,
        description="Broker name as the route declares it (1..127 of `A-Za-z0-9_.%|-`).",
        examples=["broker-a"],
    ),
]
Topic = Annotated[
    str,
    Field(
        min_length=1,
        max_length=127,
        pattern=NAME_PATTERN,
        description="Topic name (1..127 of `A-Za-z0-9_.%|-`).",
        examples=["orders"],
    ),
]
EpochMs = Annotated[int, Field(description="Epoch milliseconds on the store's clock.")]


def _whole(value: Any) -> Any:
    """``4.0`` is the integer 4: JSON has one number type, and JSON Schema's ``integer``
    matches any number without a fraction. A fraction (``4.5``) stays a float and is
    refused, as are strings and booleans (the models are strict)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: An integer field of a request body: a whole number, whether written ``4`` or ``4.0``.
WholeInt = Annotated[int, BeforeValidator(_whole)]


class Body(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        serialize_by_alias=True,
        extra="forbid",
        strict=True,
    )


class ErrorBody(Body):
    """Every error Detour answers with."""

    error: str = Field(
        description="Stable machine-readable code: VALIDATION_ERROR, NOT_FOUND, "
        "PAYLOAD_TOO_LARGE, UNSUPPORTED_MEDIA_TYPE, METHOD_NOT_ALLOWED, UNAUTHORIZED, "
        "FORBIDDEN, HOST_NOT_ALLOWED, HEADERS_TOO_LARGE, REQUEST_TIMEOUT, TABLE_FULL, "
        "STORE_UNAVAILABLE, SYSTEM_BUSY, INTERNAL.",
        examples=["VALIDATION_ERROR"],
    )
    message: str = Field(description="What went wrong, for people.", examples=["latencyMs: ..."])
    field: str | None = Field(
        description="The offending request field as a path (`brokers[0].writeQueueNums`), "
        "`body` for the body as a whole, null when no field is at fault.",
        examples=["latencyMs"],
    )


def _same_length_schema(schema: dict[str, Any]) -> None:
    """State in the JSON schema what ``_same_length`` checks: ``latencyMax`` and
    ``notAvailableDuration`` have as many entries (an omitted one is its default)."""
    fields = {f.name: f for f in CONFIG_FIELDS}
    tiers, windows = fields["latency_max"], fields["not_available_duration"]
    given = len(tiers.default)

    def length(n: int) -> dict[str, int]:
        return {"minItems": n, "maxItems": n}

    schema["anyOf"] = [
        {"not": {"required": [tiers.wire]}, "properties": {windows.wire: length(given)}},
        {"not": {"required": [windows.wire]}, "properties": {tiers.wire: length(given)}},
        *(
            {
                "required": [tiers.wire, windows.wire],
                "properties": {tiers.wire: length(n), windows.wire: length(n)},
            }
            for n in range(1, tiers.max_items + 1)
        ),
    ]


class _ConfigRules(Body):
    """The rules across Config fields; ConfigBody adds the fields, derived from Config."""

    model_config = ConfigDict(json_schema_extra=_same_length_schema)

    @field_validator("latency_max", check_fields=False)
    @classmethod
    def _increasing(cls, v: list[int]) -> list[int]:
        if any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError("must be strictly increasing")
        return v

    @field_validator("not_available_duration", check_fields=False)
    @classmethod
    def _same_length(cls, v: list[int], info: ValidationInfo) -> list[int]:
        tiers = info.data.get("latency_max")
        if tiers is not None and len(tiers) != len(v):
            raise ValueError(f"must have as many entries as latencyMax ({len(tiers)})")
        return v


def _config_type(f: ConfigField) -> Any:
    """The pydantic type of one Config field, from its declaration in detour.model."""
    if f.kind is tuple:
        return list[Annotated[int, Field(ge=f.ge, le=f.le), BeforeValidator(_whole)]]
    kind: Any = Literal.__getitem__(f.choices) if f.choices else f.kind
    return WholeInt if kind is int else kind


def _config_field(f: ConfigField, *, required: bool = False) -> tuple[Any, Any]:
    """A pydantic (type, Field) for one Config field: with its default (``GET /config``'s
    body), or ``required`` (``PUT /config``, a whole config)."""
    limits: dict[str, Any] = (
        {"min_length": 1, "max_length": f.max_items}
        if f.kind is tuple
        else {"ge": f.ge, "le": f.le}
    )
    example = list(f.default) if f.kind is tuple else f.default
    common = {"alias": f.wire, "description": f.description, "examples": [example], **limits}
    if required:
        return _config_type(f), Field(..., **common)
    if f.kind is tuple:
        default = list(f.default)
        # The rules across the lists hold for a default too (latencyMax alone, of another
        # length than the default notAvailableDuration, is a 422, not a 500).
        return _config_type(f), Field(
            default_factory=lambda: list(default), validate_default=True, **common
        )
    return _config_type(f), Field(f.default, **common)


def _patch_field(f: ConfigField) -> tuple[Any, Any]:
    """One field of a merge patch: absent (unchanged), a value, or null (its default)."""
    example = list(f.default) if f.kind is tuple else f.default
    limits: dict[str, Any] = (
        {"min_length": 1, "max_length": f.max_items}
        if f.kind is tuple
        else {"ge": f.ge, "le": f.le}
    )
    return _config_type(f) | None, Field(
        None, alias=f.wire, description=f.description, examples=[example], **limits
    )


#: The named configs (detour/profiles.py).
ProfileName = Literal["recommended", "rocketmq-4"]
_PROFILE_OUT = (
    ProfileName | None,
    Field(
        None,
        description="The profile (detour/profiles.py) whose every field this config has, or "
        "null for a config of its own: `recommended` (what a new table starts with, "
        "docs/policy.md) or `rocketmq-4` (exactly RocketMQ 4.x, docs/semantics.md). Read "
        "only: a `PUT` may send it back with the rest of a `GET`'s body, and it is ignored "
        "there (the fields say it all); `PATCH` with a profile starts from it.",
        examples=["recommended"],
    ),
)
_PROFILE_PATCH = (
    ProfileName | None,
    Field(
        None,
        description="Start from this profile (every field to its value; detour/profiles.py), "
        'then apply the other fields named: `{"profile": "rocketmq-4"}` is exact '
        'RocketMQ 4.x, `{"profile": "recommended"}` the out-of-the-box config.',
        examples=["rocketmq-4"],
    ),
)

# The fields exist only at run time: type checkers see the rules' class, FastAPI and the
# OpenAPI document the whole model.
if TYPE_CHECKING:
    ConfigBody = _ConfigRules
    ConfigReplace = _ConfigRules
    ConfigPatch = Body
else:
    ConfigBody = create_model(
        "ConfigBody",
        __base__=_ConfigRules,
        __module__=__name__,
        __doc__="The fault strategy's settings, one per deployment.",
        profile=_PROFILE_OUT,
        **{f.name: _config_field(f) for f in CONFIG_FIELDS},
    )
    ConfigReplace = create_model(
        "ConfigReplace",
        __base__=_ConfigRules,
        __module__=__name__,
        __doc__="A whole config for `PUT /config`: every field, none left out (a partial "
        "body would silently put the others back to their defaults, so it is refused with "
        "422 naming what is missing; `PATCH /config` changes only what it names).",
        profile=_PROFILE_OUT,
        **{f.name: _config_field(f, required=True) for f in CONFIG_FIELDS},
    )
    ConfigPatch = create_model(
        "ConfigPatch",
        __base__=Body,
        __module__=__name__,
        __doc__="A JSON merge patch of the config (RFC 7396, `application/merge-patch+json`): "
        "the fields named change, the others stay as they are; `null` puts a field back to "
        "its default. The result must be a valid config (422 naming the field otherwise).",
        profile=_PROFILE_PATCH,
        **{f.name: _patch_field(f) for f in CONFIG_FIELDS},
    )


class BrokerSpec(Body):
    broker_name: BrokerName
    write_queue_nums: WholeInt = Field(
        ge=1, le=1024, description="Number of write queues on this broker, 1..1024.", examples=[4]
    )
    address: str | None = Field(
        None,
        min_length=3,
        max_length=255,
        # The port 1..65535 in the pattern itself, so that the contract says it too.
        pattern=r"^[A-Za-z0-9.\-\[\]:]+:(?:[1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}"
        r"|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])$",
        description="The broker's `host:port`, returned with a select; optional.",
        examples=["10.0.0.5:10911"],
    )


class RouteBody(Body):
    """A topic's brokers; the queue list is ordered by brokerName, then queueId."""

    brokers: list[BrokerSpec] = Field(
        min_length=1,
        max_length=256,
        # The names are distinct (``_distinct``): JSON Schema states distinct items, and
        # ``x-unique-item-properties`` the property that must differ.
        json_schema_extra={"uniqueItems": True, "x-unique-item-properties": ["brokerName"]},
        description="1..256 brokers with distinct names (no two with the same `brokerName`).",
        examples=[[{"brokerName": "broker-a", "writeQueueNums": 4, "address": "10.0.0.5:10911"}]],
    )

    @field_validator("brokers")
    @classmethod
    def _distinct(cls, v: list[BrokerSpec]) -> list[BrokerSpec]:
        names = [b.broker_name for b in v]
        if len(set(names)) != len(names):
            raise ValueError("broker names must be distinct")
        return v


class RouteOut(Body):
    topic: Topic
    brokers: list[BrokerSpec] = Field(
        description="The route's brokers, by name.",
        examples=[[{"brokerName": "broker-a", "writeQueueNums": 4, "address": "10.0.0.5:10911"}]],
    )


class RoutesOut(Body):
    routes: list[RouteOut] = Field(
        description="Every registered route, by topic.",
        examples=[
            [
                {
                    "topic": "orders",
                    "brokers": [{"brokerName": "broker-a", "writeQueueNums": 4, "address": None}],
                }
            ]
        ],
    )


class QueueRef(Body):
    broker_name: BrokerName
    queue_id: WholeInt = Field(ge=0, le=1023, description="Queue id on that broker.", examples=[0])


class SelectRequest(Body):
    topic: Topic
    last_broker_name: BrokerName | None = Field(
        None,
        description="The broker the previous attempt of this message failed on; avoided when "
        "another available broker exists.",
        examples=[None],
    )
    queues: list[QueueRef] | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="Inline queue list used instead of the registered route (duplicates are "
        "ignored; no addresses).",
        examples=[None],
    )
    producer: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.:@%|/-]{1,128}$",
        description="Who asks: brokers this producer alone failed on (short of "
        "`isolationQuorum`) or answered slowly from (short of `latencyQuorum`) are avoided "
        "for it.",
        examples=["spark-executor-3"],
    )
    sharding_key: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Ordered messages: the queue is `queues[crc32(utf8(key)) % n]` of the route's "
        "queue list, the same for every select with this key; see `orderedFallback`.",
        examples=["order-42"],
    )


class SelectResponse(Body):
    topic: Topic
    broker_name: BrokerName
    queue_id: int = Field(description="Queue id on the chosen broker.", examples=[2])
    address: str | None = Field(
        description="The broker's address from the route, if registered.",
        examples=["10.0.0.5:10911"],
    )
    decision: Literal["available", "pick_one_at_least", "round_robin"] = Field(
        description="`available`: an available broker; `pick_one_at_least`: every broker is "
        "avoided and the least bad was chosen; `round_robin`: avoidance is off.",
        examples=["available"],
    )
    avoided_brokers: list[str] = Field(
        description="Brokers this select passed over because their window is open, in the "
        "order met; never the returned broker. Only what this one select's round-robin walk "
        "crossed, not every avoided broker: a walk that starts past an avoided broker's "
        "queues crosses none, and a crossing moves the topic's counter past them, so while "
        "one broker is avoided most answers say `[]` and some name it (4 brokers with the "
        "same queues, one avoided: one select in 12). That flip is expected. Which brokers "
        "are avoided now: `GET /fault-items` (`available: false`) or the "
        "`detour_broker_avoided` gauge.",
        examples=[["broker-b"]],
    )
    degraded: bool = Field(
        description="Decided from this replica's copy while Redis is unreachable.",
        examples=[False],
    )
    panic: bool = Field(
        description="Fewer brokers than `panicThresholdPercent` were available: avoidance was "
        "ignored for this select.",
        examples=[False],
    )
    dry_run: bool = Field(
        description="Open windows were counted but not obeyed (`enforcementPercent`).",
        examples=[False],
    )
    unenforced_brokers: list[str] = Field(
        description="Brokers with an open window this select did not avoid: panic, a dry run, "
        "or past `maxAvoidedPercent` (then the least bad).",
        examples=[[]],
    )
    probe: bool = Field(
        description="This select is the probe for a broker whose window ended "
        "(`probeOnExpiry`, `earlyRecovery`): report its outcome; only a success re-opens the "
        "broker to all.",
        examples=[False],
    )
    ordered: Literal["home", "wait", "remap"] | None = Field(
        description="With `shardingKey`: `home` (the key's queue), `wait` (the key's queue "
        "although its broker is avoided) or `remap` (moved to the next available queue); null "
        "without a key.",
        examples=[None],
    )


class ReportRequest(Body):
    broker_name: BrokerName
    latency_ms: float = Field(
        ge=0,
        le=MAX_LATENCY_MS,
        allow_inf_nan=False,
        description="The send's latency in ms, 0..3600000; fractions are truncated.",
        examples=[120],
    )
    isolation: bool = Field(
        False,
        description="The send failed: the latency counts as isolationLatencyMs.",
        examples=[False],
    )
    origin: Literal["broker", "local"] | None = Field(
        None,
        description="Where a failure came from: `broker` (the broker answered with an error or "
        "too slowly) isolates at once; `local` (connect refused, timeout: maybe the producer's "
        "own network) or unstated counts toward `isolationQuorum` (a slow answer's toward "
        "`latencyQuorum`).",
        examples=[None],
    )
    producer: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.:@%|/-]{1,128}$",
        description="Who sent (host, pod, executor id): recorded in the latency log, and the "
        "voter for `isolationQuorum` and `latencyQuorum` (reports without one vote as one "
        "anonymous producer).",
        examples=["spark-executor-3"],
    )
    report_id: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.:@%|/-]{1,64}$",
        description="The report's identity, chosen by the producer (unique per report): a "
        "report whose id was applied in the last 15 minutes is not applied again (a batch "
        "retried after a lost reply, an SDK's replay). The answer then shows the window as it "
        "is, with `notAvailableDurationMs` the window the report asked for.",
        examples=["c0ffee12-42"],
    )
    pending: bool = Field(
        False,
        description="An in-flight signal (`pendingQuorum`): the send has not completed; "
        "`latencyMs` is how long it has been outstanding so far. Enough producers with one "
        "open avoid the broker before any timeout fires; the producer's next report that is "
        "not pending (the send completed or failed) withdraws it. `isolation` and `origin` "
        "are ignored on a pending report; with `pendingQuorum` 0 it changes nothing.",
        examples=[False],
    )


#: Most reports in one batch call.
MAX_BATCH = 1000


class BatchReport(ReportRequest):
    age_ms: WholeInt = Field(
        0,
        ge=0,
        le=MAX_REPORT_AGE_MS,
        description="How long ago the send completed, in ms (a client replaying reports it "
        "queued while Detour was unreachable): the window is computed from that moment. "
        "At most a day, the longest window a config may set.",
        examples=[0],
    )


#: One report of a batch as the route takes it: a JSON object, validated as a ``BatchReport``
#: by the route itself, a few at a time with the event loop free between them (a whole
#: batch's validation held it for ~10 ms: service/api/reports.py). The contract shows the
#: model.
BatchItem = Annotated[dict[str, Any], WithJsonSchema(BatchReport.model_json_schema(by_alias=True))]


class BatchReportRequest(Body):
    reports: list[BatchItem] = Field(
        min_length=1,
        max_length=MAX_BATCH,
        description="1..1000 reports, all validated, then applied in order in chunks of 25 "
        "(each chunk one atomic store operation).",
        examples=[[{"brokerName": "broker-a", "latencyMs": 120, "isolation": False}]],
    )


class ReportResponse(Body):
    broker_name: BrokerName
    latency_ms: int = Field(description="The latency recorded, whole ms.", examples=[120])
    not_available_duration_ms: int = Field(
        description="The window this report asked for (0 when avoidance is off).",
        examples=[0],
    )
    available_at: EpochMs = Field(
        description="The broker's window end after the update (epoch ms).",
        examples=[1763791234567],
    )
    degraded: bool = Field(
        description="Redis did not answer: applied to this replica's copy and journaled; "
        "replayed, dated from now, when Redis is back.",
        examples=[False],
    )
    duplicate: bool = Field(
        False,
        description="The report's `reportId` was applied already (within 15 minutes, in its "
        "token's scope): nothing changed, and the answer is the one the first report got.",
        examples=[False],
    )
    expired: bool = Field(
        False,
        description="The report carries a `reportId` its scope's id memory may have forgotten "
        "(dated more than 14 minutes 55 s ago, or no later than 5 s after the newest id "
        "that 100,000 newer ones pushed out): not applied, so that a replay is never applied "
        "twice; `availableAt` is the broker's window end as it is. A producer counts it as "
        "not delivered.",
        examples=[False],
    )


class WhyOut(Body):
    """Why a broker's window is open: the report that set its end."""

    reason: Literal["isolation", "latency", "quorum", "pending", "probe"] = Field(
        description="What set it: `isolation` (a failed send), `latency` (a slow answer's "
        "tier, also once slow answers of enough producers reached `latencyQuorum`), `quorum` "
        "(failures of enough producers reached `isolationQuorum`), `pending` (in-flight "
        "signals of enough producers: a hang) or `probe` (a probation probe failed).",
        examples=["isolation"],
    )
    since: EpochMs = Field(
        description="When that report's send completed (epoch ms).", examples=[1763791234567]
    )
    latency_ms: int = Field(
        description="The latency it measured (ms): with latencyMax, the window's tier.",
        examples=[3001],
    )
    by: str = Field(
        description="Who set it: the producer, or the token's name when tokens are on; "
        "empty when the report named none.",
        examples=["spark-executor-3"],
    )


class FaultItemOut(Body):
    broker_name: BrokerName
    current_latency_ms: int = Field(description="Latency of the last report.", examples=[120])
    available_at: EpochMs = Field(description="Window end (epoch ms).", examples=[1763791234567])
    available: bool = Field(description="Whether the window has ended at `now`.", examples=[True])
    probation: bool = Field(
        description="Waiting for a probe (`probeOnExpiry`, or `earlyRecovery` once the detector "
        "found the broker back): once the window ends, only a probe is sent until a success "
        "re-opens the broker.",
        examples=[False],
    )
    reachable: bool | None = Field(
        description="The active detector's last reading (a TCP connect to the broker's address "
        "succeeded); null when never checked.",
        examples=[None],
    )
    why: WhyOut | None = Field(
        description="Why the window is open (the report that set its end); null when the "
        "broker is available.",
        examples=[None],
    )


class FaultItemsOut(Body):
    now: EpochMs = Field(
        description="The store's time the items were judged at (epoch ms).",
        examples=[1763791200000],
    )
    items: list[FaultItemOut] = Field(
        description="Every fault item, by broker name.", examples=[[]]
    )


class Health(Body):
    status: Literal["ok", "ready"] = Field(description="`ok` (alive) or `ready`.", examples=["ok"])
    store: Literal["memory", "redis"] = Field(description="The store in use.", examples=["redis"])
    degraded: bool = Field(
        description="Redis is unreachable: answering from this replica's copy, reports "
        "journaled for replay.",
        examples=[False],
    )


class BatchReportResponse(Body):
    results: list[ReportResponse] = Field(
        description="One result per report, in the request's order.",
        examples=[
            [
                {
                    "brokerName": "broker-a",
                    "latencyMs": 120,
                    "notAvailableDurationMs": 0,
                    "availableAt": 1763791234567,
                }
            ]
        ],
    )


class LogEntryOut(Body):
    id: str = Field(
        description="Log position; pass it as `after` to read on.", examples=["1763791234567-0"]
    )
    broker_name: BrokerName
    latency_ms: int = Field(description="Reported latency (ms).", examples=[120])
    isolation: bool = Field(description="The send failed.", examples=[False])
    producer: str = Field(description="Reporter, empty when not given.", examples=["exec-3"])
    at: EpochMs = Field(description="When the send completed (epoch ms).", examples=[1763791234567])
    histogram: list[int] | None = Field(
        None,
        description="Set on a histogram entry: one replica's reports of one producer that "
        "changed no window, counted per latency bucket (the buckets' lower bounds, ms: 0, 5, "
        "10, ... 60000, docs/semantics.md), sent between `since` and `at`; `latencyMs` is "
        "-1. Left out on an entry for one report.",
        examples=[[0, 4, 17, 2]],
    )
    since: EpochMs | None = Field(
        None, description="A histogram entry's first report (epoch ms).", examples=[1763791233567]
    )


class LatencyLogOut(Body):
    entries: list[LogEntryOut] = Field(description="Oldest first.", examples=[[]])
    next: str | None = Field(
        description="The `after` for the next page; null when this page is empty.",
        examples=["1763791234567-0"],
    )


class EventOut(Body):
    id: str = Field(
        description="Log position; pass it as `since` to read on.", examples=["1763791234567-0"]
    )
    kind: Literal["opened", "extended", "ended", "quorum"] = Field(
        description="`opened`: a window opened; `extended`: an open window moved; `ended`: a "
        "window ended early; `quorum`: opened because `isolationQuorum` (or `latencyQuorum`) "
        "producers agreed.",
        examples=["opened"],
    )
    reason: Literal[
        "isolation", "latency", "quorum", "success", "operator", "probe", "recovery", "pending"
    ] = Field(
        description="`isolation` (a failure), `latency` (a slow answer), `quorum`, `success` "
        "(a report under `lastReportWins` ended it), `operator` (`DELETE /fault-items`), "
        "`probe` (a probe's success re-opened the broker, or its failure re-isolated it), "
        "`recovery` (a replica wrote the window back into a Redis that had lost it), "
        "`pending` (producers with sends outstanding reached `pendingQuorum`).",
        examples=["isolation"],
    )
    broker_name: BrokerName
    tier_ms: int | None = Field(
        description="The latencyMax (ms) of the tier the window came from; null when none.",
        examples=[15000],
    )
    reporters: int = Field(
        description="Producers behind it: the quorum's voters, 1 for a report, 0 for an operator.",
        examples=[1],
    )
    available_at: EpochMs = Field(
        description="The window end after the event (epoch ms).", examples=[1763791834567]
    )
    at: EpochMs = Field(description="When it happened (epoch ms).", examples=[1763791234567])


class EventsOut(Body):
    events: list[EventOut] = Field(description="Oldest first.", examples=[[]])
    next: str | None = Field(
        description="The `since` for the next page; null when this page is empty.",
        examples=["1763791234567-0"],
    )
