"""Every Prometheus metric Detour exports, defined once, with its buckets and series caps.

Counters and histograms count what this process did; with several uvicorn
workers they go through prometheus-client's multiprocess mode (files in
``PROMETHEUS_MULTIPROC_DIR``, set by ``python -m service``) so a scrape of any
worker adds up all of them. Per-broker state (avoided, seconds until
available, routes in panic) is *derived from the shared table* at scrape time
(service/api/exposition.py), so every replica reports the same truth whichever
replica made the change. The counting helpers live with their callers
(service/api/telemetry.py); this module imports nothing of Detour, so any layer
may count.

Label cardinality: ``namespace`` is one of the configured namespaces (fixed at
start). ``broker`` on counters takes the first ``metrics_max_brokers`` (default
``MAX_BROKER_SERIES``) broker names this process sees; later ones count under
``broker="_other"`` (a flood of invented names cannot grow the process or the
Prometheus series). No histogram is per broker: 17 series each did not earn their
cost (a scrape of 1,000 brokers was 2 MB). The table's gauges list at most as many
brokers per namespace, avoided ones first; the totals are always complete.
``decision``, ``outcome``, ``tier`` (a ``latencyMax`` value, at most 32), ``route``
(the route template, never the raw path), ``method``, ``status``, ``op`` and
``reason`` are fixed sets. Topics appear only on ``detour_route_all_avoided``,
capped at ``MAX_TOPIC_SERIES`` topics (by name); the total is always in
``detour_routes_all_avoided``. Producer ids are never labels.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

# A `_created` twin per counter and histogram would nearly double the series.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: Seconds. Every default latencyMax tier (0.05 ... 15 s) is a bucket boundary, so
#: `le` lines up with the tiers on the heatmap; custom tiers fall between buckets.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.55,
    1.0,
    2.0,
    3.0,
    5.0,
    10.0,
    15.0,
    30.0,
    60.0,
)
#: Seconds, for Detour's own endpoints and Redis calls.
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MAX_TOPIC_SERIES = 100
MAX_BROKER_SERIES = 1000
OTHER_BROKER = "_other"

SELECTS = Counter("detour_selects_total", "Selects by decision.", ["namespace", "decision"])
SELECTS_AVOIDING = Counter(
    "detour_selects_avoiding_total",
    "Selects that passed over at least one avoided broker (or had to pickOneAtLeast): "
    "divided by detour_selects_total, the avoidance ratio.",
    ["namespace"],
)
SELECT_AVOIDED = Counter(
    "detour_select_avoided_total",
    "Brokers passed over by a select because their avoidance window was open.",
    ["namespace", "broker"],
)
REPORTS = Counter(
    "detour_reports_total",
    "Reports by broker and outcome: ok, isolation, or pending (an in-flight signal).",
    ["namespace", "broker", "outcome"],
)
REPORTS_REFUSED = Counter(
    "detour_reports_refused_total",
    "Reports refused whole: reason=table_full (a new broker while the namespace's table "
    "held max_brokers open windows).",
    ["namespace", "reason"],
)
REPORTED_LATENCY = Histogram(
    "detour_reported_latency_seconds",
    "Latency producers reported, per namespace (a broker's own is "
    "detour_broker_current_latency_seconds).",
    ["namespace"],
    buckets=LATENCY_BUCKETS,
)
WINDOWS_OPENED = Counter(
    "detour_windows_opened_total",
    "Avoidance windows opened (the broker was available before), by broker and tier "
    "(the tier's latencyMax in ms).",
    ["namespace", "broker", "tier"],
)
WINDOWS_EXTENDED = Counter(
    "detour_windows_extended_total",
    "Open windows a report moved, by broker.",
    ["namespace", "broker"],
)
EVICTED = Counter(
    "detour_fault_items_evicted_total",
    "Fault items whose window had ended, dropped to make room in a full table.",
    ["namespace"],
)
AVOIDANCE = Counter(
    "detour_avoidance_selects_total",
    "Selects that met at least one open window, by what they did: enforced (obeyed every "
    "one), limited (maxAvoidedPercent: the least bad served), panic (panicThresholdPercent: "
    "all ignored) or dry_run (enforcementPercent: counted, not obeyed). The sum is the "
    "detected avoidance; outcome=enforced plus limited is the enforced one.",
    ["namespace", "outcome"],
)
ORDERED = Counter(
    "detour_ordered_selects_total",
    "Selects with a shardingKey, by placement: home (the key's queue), wait (the key's queue "
    "on an avoided broker) or remap (moved to the next available queue).",
    ["namespace", "placement"],
)
QUORUM = Counter(
    "detour_quorum_reports_total",
    "Failures subject to isolationQuorum, slow answers subject to latencyQuorum and "
    "in-flight signals subject to pendingQuorum, by broker and outcome: suspected (short "
    "of the quorum: only the reporter avoids the broker) or reached (the window opened for "
    "everyone).",
    ["namespace", "broker", "outcome"],
)
EVENTS = Counter(
    "detour_window_events_total",
    "Event log entries written by this process: kind opened, extended, ended (early) or "
    "quorum; reason isolation, latency, quorum, success (lastReportWins) or operator.",
    ["namespace", "kind", "reason"],
)
ISOLATION_WINDOWS = Counter(
    "detour_isolation_windows_total",
    "Avoidance windows a failure opened or extended, by broker and reason: isolation (a "
    "failed send), quorum (failures reached isolationQuorum), probe (a probation probe "
    "failed) or pending (in-flight signals reached pendingQuorum: a hang). What the "
    "DetourBrokerIsolated alert names.",
    ["namespace", "broker", "reason"],
)
PROBES = Counter(
    "detour_probes_total",
    "Probation probes (probeOnExpiry): sent (a select was given a broker whose window "
    "ended), passed (its success re-opened the broker to all), failed (it re-isolated it).",
    ["namespace", "outcome"],
)
DETECTIONS = Counter(
    "detour_detector_checks_total",
    "The active detector's TCP connects to avoided brokers, by result (reachable, "
    "unreachable); only the replica holding the namespace's detector lease checks.",
    ["namespace", "result"],
)
HTTP_DURATION = Histogram(
    "detour_http_request_duration_seconds",
    "Time to answer Detour's own endpoints.",
    ["route", "method", "status"],
    buckets=FAST_BUCKETS,
)
STORE_ERRORS = Counter("detour_store_errors_total", "Store calls that failed.", ["op"])
STORE_ROUNDTRIP = Histogram(
    "detour_store_roundtrip_seconds", "Store call round-trip time.", ["op"], buckets=FAST_BUCKETS
)
SHED = Counter(
    "detour_requests_shed_total",
    "Requests refused at once to bound the work in flight.",
    ["reason"],
)
EDGE_REFUSED = Counter(
    "detour_edge_refused_total",
    "Requests or connections the HTTP edge refused or closed before Detour's app: "
    "reason=connections (at the cap, none idle), peer_connections (the peer's cap), "
    "idle_evicted (an idle connection closed for a new one), reading_evicted (none idle: "
    "an unproven one still reading its request closed for a new one), idle_timeout (no request "
    "begun in time by a connection that had not proven itself), headers_too_large, "
    "too_many_headers, body_too_large (what followed a head passed any body's bound: "
    "chunk framing, trailers), header_timeout, body_timeout, send_timeout (answers not taken while "
    "the pipelining bound held the connection), host, malformed (the HTTP parser refused it), "
    "unread_reset (closed at one of those deadlines with bytes it had not read: reset, so that "
    "the kernel does not keep them).",
    ["reason"],
)
STREAMS_REFUSED = Counter(
    "detour_push_streams_refused_total",
    "Push stream connects refused: reason=token (429, the token's cap on this replica) or "
    "process (503, the replica's cap).",
    ["reason"],
)
STREAMS_DROPPED = Counter(
    "detour_push_streams_dropped_total",
    "Push streams closed because their client read nothing for stream_send_timeout_s.",
)
RESYNCS = Counter("detour_view_resyncs_total", "Full resyncs of this replica's table copy.")
RESEEDS = Counter(
    "detour_store_reseeds_total",
    "Times this replica merged what it holds into a Redis table that may have lost or rolled "
    "back data, by the sign that led to it: empty (no epoch), epoch (another table), behind "
    "(a mark, version or stamp went back), restart (the server lost this replica's mark), "
    "failover (the Sentinel master moved), merge (another replica announced one).",
    ["cause"],
)
RESEEDED = Counter(
    "detour_store_reseeded_total",
    "Entries a merge of this replica wrote into the Redis table, by kind (config, route, "
    "window, delete).",
    ["kind"],
)
UNRECOVERABLE = Counter(
    "detour_store_unrecoverable_total",
    "Table losses that took data no replica holds with them: the latency log and the event "
    "log (their entries before the loss are gone), by what was lost.",
    ["what"],
)
DUPLICATE_REPORTS = Counter(
    "detour_reports_duplicate_total",
    "Reports whose identity Redis had applied already (a late reply replayed, a retried "
    "batch, an SDK replay): skipped, nothing changed.",
)
EXPIRED_REPORTS = Counter(
    "detour_reports_expired_total",
    "Reports carrying an id their scope's id memory may have forgotten (dated before its "
    "horizon: older than the window, or than the newest id its cap pushed out): answered "
    "expired, not applied, so never applied twice.",
)
REPORTS_LOCAL = Counter(
    "detour_reports_local_total",
    "Reports that changed nothing another replica must see (policy.quiet): summed on this "
    "replica and written with the next flush, not one store write each.",
)
FLUSHES = Counter(
    "detour_report_flushes_total",
    "Flushes of the reports kept local: one script call, one summary per broker.",
)
JOURNAL_SIZE = Gauge(
    "detour_journal_reports",
    "Reports accepted while Redis was unreachable, not yet replayed.",
    multiprocess_mode="livesum",
)
JOURNAL_DROPPED = Counter(
    "detour_journal_dropped_total",
    "Journaled reports dropped: reason=full (journal at its cap, oldest dropped), expired "
    "(older than an hour at replay) or table_full (a new broker with no room at replay).",
    ["reason"],
)
JOURNAL_REPLAYED = Counter(
    "detour_journal_replayed_total", "Journaled reports handed to Redis after an outage."
)
READ_FALLBACKS = Counter(
    "detour_store_read_fallbacks_total",
    "Times this process left the Redis replica it subscribed to and read from for the "
    "primary, by cause: lagging (behind what it knew of the primary, the primary losing "
    "nothing), unreachable (the replica failed a call or refused it, e.g. MASTERDOWN), none "
    "(no replica to read from).",
    ["cause"],
)
REDIS_CONNECTIONS = Gauge(
    "detour_store_redis_connections",
    "Redis connections this process holds open for the namespace, by use: subscription (the "
    "change channel), commands (polls, snapshots, admin writes), reports (report writes), "
    "replica (polls and snapshots on the fan-out tier's replica), sentinel (asking where the "
    "master is). docs/deploy.md, Sizing.",
    ["namespace", "use"],
    multiprocess_mode="livesum",
)
READING_REPLICA = Gauge(
    "detour_store_reading_replica",
    "1 while this process subscribes to and polls a Redis replica for the namespace, 0 while "
    "it does so on the primary.",
    ["namespace"],
    multiprocess_mode="livesum",
)

# Series that exist from the start, so rate() and increase() see their first event.
for _cause in ("empty", "epoch", "behind", "restart", "failover", "merge"):
    RESEEDS.labels(_cause)
for _kind in ("config", "route", "window", "delete"):
    RESEEDED.labels(_kind)
for _what in ("latency_log", "events"):
    UNRECOVERABLE.labels(_what)
for _cause in ("lagging", "unreachable", "none"):
    READ_FALLBACKS.labels(_cause)
for _op in ("report", "set_entry", "snapshot", "fault_items", "sync"):
    STORE_ERRORS.labels(_op)
for _reason in ("full", "expired", "table_full"):
    JOURNAL_DROPPED.labels(_reason)
for _reason in ("in_flight", "turn_budget", "queue_wait"):
    SHED.labels(_reason)
for _reason in (
    "connections",
    "peer_connections",
    "idle_evicted",
    "reading_evicted",
    "idle_timeout",
    "send_timeout",
    "malformed",
    "headers_too_large",
    "too_many_headers",
    "body_too_large",
    "header_timeout",
    "body_timeout",
    "host",
):
    EDGE_REFUSED.labels(_reason)
for _reason in ("token", "process"):
    STREAMS_REFUSED.labels(_reason)
