"""Process configuration, read once from flags and DETOUR_* environment variables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.store.options import StoreOptions

#: The stores' options are declared once, with their defaults, in StoreOptions (the stores
#: read no Settings); the fields of the same names below take those defaults and add the
#: bounds and the environment.
_STORE = StoreOptions()


class Settings(BaseSettings):
    """How this process runs; the fault strategy's config lives in the store, not here."""

    model_config = SettingsConfigDict(env_prefix="DETOUR_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    #: None selects the embedded memory store (one process, nothing shared). Otherwise
    #: one of (details in ``service/store/connect.py`` and docs/reliability.md):
    #: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS),
    #: ``unix://[[user]:password@]/path.sock[?db=N]``: one server;
    #: ``redis+cluster://[[user]:password@]host[:port][,host[:port]...][/]``
    #: (``rediss+cluster://`` for TLS): a Redis Cluster, any of its nodes as startup nodes;
    #: ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]``
    #: (``rediss+sentinel://`` for TLS): the master the listed sentinels (port 26379 by
    #: default) monitor as ``service``; ``?sentinel_password=`` if they require one.
    redis_url: str | None = _STORE.redis_url
    #: A file holding the Redis password (a mounted Secret), read once at start and
    #: applied to ``redis_url``'s connections, so the URL (a ConfigMap, a flag) carries no
    #: secret. The URL's user, if any, is the ACL user it authenticates as
    #: (``redis://detour@redis:6379/0``); a URL that already has a password is refused.
    #: One trailing newline is ignored.
    redis_password_file: str | None = None
    workers: int = Field(1, ge=1, le=64)
    #: Every Redis key is ``{prefix}:{namespace}:...`` with the namespace as the
    #: Cluster hash tag, so one namespace's keys live in one slot.
    redis_prefix: str = Field(_STORE.redis_prefix, pattern=r"^[A-Za-z0-9_.-]{1,32}$")
    namespace: str = Field(_STORE.namespace, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    #: How often a replica checks the table version in Redis: the bound on how
    #: long a missed push can go unnoticed (seconds).
    sync_interval_s: float = Field(_STORE.sync_interval_s, gt=0, le=60)
    #: Redis socket timeout for sync, snapshots and admin writes (seconds).
    redis_timeout_s: float = Field(_STORE.redis_timeout_s, gt=0, le=60)
    #: Timeout of a report's Redis call (seconds): past it the report goes to the journal.
    redis_call_timeout_s: float = Field(_STORE.redis_call_timeout_s, gt=0, le=60)
    #: Connections each of a namespace's two Redis clients (sync and admin; reports) may hold
    #: at once, per node in a Cluster; past it a call waits for one (docs/deploy.md, "Sizing").
    redis_max_connections: int = Field(_STORE.redis_max_connections, ge=1, le=1024)
    #: A Redis client that sent nothing for this long closes its idle connections; one that
    #: did keeps one per server (seconds). A sidecar at rest then holds two connections.
    redis_idle_close_s: float = Field(_STORE.redis_idle_close_s, gt=0, le=3600)
    #: The fan-out tier: Redis replicas of ``redis_url``'s server from which this process
    #: subscribes to pushes and reads its polls and snapshots (writes and scripts that write
    #: go to the primary): ``host:port[,host:port...]`` (one is picked at random, the next
    #: after a failure), or ``sentinel`` with a ``redis+sentinel://`` URL (the replicas the
    #: sentinels list). Empty: everything on the primary. Not for ``redis+cluster://``.
    redis_replicas: str = Field(_STORE.redis_replicas, max_length=4096)
    #: A replica whose table stays behind what this process knows of the primary's for this
    #: long is left for the primary (seconds).
    redis_replica_max_lag_s: float = Field(_STORE.redis_replica_max_lag_s, gt=0, le=600)
    #: While on a replica, how often the primary's table version is read (one keyed call):
    #: the bound on how long a replica that stopped replicating goes unnoticed by a process
    #: that writes nothing (seconds).
    redis_primary_poll_s: float = Field(_STORE.redis_primary_poll_s, gt=0, le=3600)
    #: After leaving a replica, how long this process reads from the primary before it tries
    #: a replica again (seconds).
    redis_replica_retry_s: float = Field(_STORE.redis_replica_retry_s, gt=0, le=3600)
    #: Reports the journal holds while Redis is unreachable; when full the oldest is dropped.
    journal_max: int = Field(_STORE.journal_max, ge=1, le=10_000_000)
    #: Largest request body accepted (bytes); larger ones get 413.
    max_body_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024)
    #: The same for POST /report-latency:batch (up to 1,000 reports).
    max_batch_body_bytes: int = Field(256 * 1024, ge=1024, le=16 * 1024 * 1024)
    #: Reports kept in the latency log (a Redis stream, trimmed approximately); 0 = no log.
    latency_log_max: int = Field(_STORE.latency_log_max, ge=0, le=10_000_000)
    #: How long a replica may sum the reports that change no window (docs/semantics.md)
    #: before it writes them (their brokers' latest latency and one latency-log histogram
    #: per broker) to the store; 0 = every report written at once, as one script call.
    report_flush_ms: int = Field(_STORE.report_flush_ms, ge=0, le=60_000)
    #: Events kept in the event log (windows opened, extended, ended early; a Redis stream,
    #: trimmed approximately); 0 = no log.
    events_max: int = Field(_STORE.events_max, ge=0, le=1_000_000)
    #: Seconds SIGTERM waits for requests in flight (an open push stream is cut after it).
    shutdown_grace_s: int = Field(5, ge=0, le=300)
    #: Requests being handled at once before new ones get 503 SYSTEM_BUSY; the first
    #: such refusal also starts shedding (``turn_budget_ms``). The default never refuses
    #: a few hundred producers that each wait for their answer.
    max_in_flight: int = Field(256, ge=1, le=100_000)
    #: A request that waited longer than this (ms) before being served gets 503 SYSTEM_BUSY
    #: (RocketMQ's waitTimeMillsInSendQueue).
    max_queue_wait_ms: float = Field(200.0, ge=0, le=60_000)
    #: While shedding (from an in-flight or queue-wait refusal until 1 s after the last;
    #: while the loop is saturated, the limit's own refusals count as well), each turn
    #: of the event loop starts only as many requests as keep its CPU time near this
    #: (ms), and refuses the rest at once: refusals then wait at most about one such
    #: turn. 0 = off (the in-flight bound alone). docs/reliability.md, "Overload".
    turn_budget_ms: float = Field(0.5, ge=0, le=1_000)
    #: Selects, and reports kept on this replica, answered by the server protocol itself
    #: when they never wait (service/edge/direct.py); off: every request goes through ASGI.
    #: Same answers either way; off costs about three times the CPU per select.
    direct_lane: bool = True
    log_level: str = Field("info", pattern=r"^(critical|error|warning|info|debug|trace)$")
    #: A YAML or JSON file of tokens (docs/security.md); ``tokens`` holds the same text
    #: inline (for a Secret mounted as an environment variable). Neither: the service
    #: runs open, with every request in ``namespace``.
    tokens_file: str | None = None
    tokens: str | None = None
    #: Binding a non-loopback ``host`` with no tokens configured refuses to start
    #: unless this is set: an open Detour on a network lets anyone steer producers.
    allow_open: bool = False
    #: Fault items one namespace's table may hold. A report for a new broker when it is
    #: full first drops items whose window has ended; if none has, it is refused (409).
    max_brokers: int = Field(_STORE.max_brokers, ge=1, le=1_000_000)
    #: The config a new table starts with (detour/profiles.py): ``recommended`` (the
    #: settings docs/policy.md recommends for a shared table) or ``rocketmq-4`` (exactly
    #: RocketMQ 4.x). Only a table that never had a config written takes it; with Redis,
    #: the first replica to find none writes it, and the table's config is then shared.
    profile: Literal["recommended", "rocketmq-4"] = _STORE.profile

    # The HTTP edge: bounds on what a client can hold or send before Detour's app runs,
    # as nginx and Envoy bound them (docs/security.md, "The HTTP edge").
    #: Request line plus headers (bytes): past it, 431 and the connection closed (nginx
    #: allows 4 x 8 KiB, Envoy 60 KiB).
    max_header_bytes: int = Field(32 * 1024, ge=1024, le=1024 * 1024)
    #: Headers in one request: past it, 431 (Envoy's default, 100).
    max_headers: int = Field(100, ge=8, le=10_000)
    #: Seconds a request's head may take from its first byte (or the connection's
    #: opening) to its end: past it, 408 and close (Envoy's request_headers_timeout).
    header_timeout_s: float = Field(5.0, gt=0, le=300)
    #: Seconds a request's body may take from the end of its head: past it, 408 and close.
    body_timeout_s: float = Field(5.0, gt=0, le=300)
    #: Open connections per process (clamped below the process's open-file limit): at the
    #: bound a new connection closes an idle one (one that has not proven itself first,
    #: then from the peer holding the most, then the oldest); with none idle it is closed.
    max_connections: int = Field(512, ge=1, le=100_000)
    #: Open connections one peer address may hold: past it, its new ones are closed.
    max_connections_per_peer: int = Field(256, ge=1, le=100_000)
    #: Seconds a connection that has not proven itself (no valid token shown; on an open
    #: Detour, no request served yet) may stay idle; a proven one keeps uvicorn's 5 s.
    unproven_idle_s: float = Field(1.0, gt=0, le=300)
    #: The kernel buffers of every connection's socket, each way (bytes; Linux doubles
    #: each): fixed, so what one connection may hold in the kernel is bounded whatever its
    #: client does (not reading its answers, sending faster than it is read), where
    #: autotuning lets a socket queue megabytes, charged to the pod by cgroup v2. At the
    #: defaults, 512 connections hold at most 128 MiB of socket memory (docs/security.md).
    socket_buffer_bytes: int = Field(64 * 1024, ge=4096, le=16 * 1024 * 1024)
    #: Host names (comma-separated, no port) requests may name besides loopback names
    #: and IP literals; ``*`` allows any. Against DNS rebinding: a web page that makes its
    #: own name resolve to 127.0.0.1 still sends that name as Host. Checked on an open
    #: Detour always, with tokens only when set (a page cannot present a token).
    allowed_hosts: str | None = None

    # -- Streams, scrapes and names (docs/security.md, "Streams, scrapes and names") --
    #: Push streams (GET /fault-items/stream) this process serves at once; past it a
    #: connect gets 503 SYSTEM_BUSY. Never more than half of ``max_connections``
    #: (service/edge/bounds.py ``stream_bound``): streams are never idle.
    stream_max: int = Field(256, ge=1, le=100_000)
    #: Push streams one token may hold open on this process; past it 429 TOO_MANY_STREAMS.
    #: (No tokens: only ``stream_max`` applies.)
    stream_max_per_token: int = Field(128, ge=1, le=100_000)
    #: A push stream whose client reads nothing for this long, its send buffer full, is
    #: dropped (seconds).
    stream_send_timeout_s: float = Field(10.0, gt=0, le=600)
    #: The kernel send buffer of a push stream's socket (bytes; Linux doubles it): fixed,
    #: so a client that stops reading is found out (and dropped) after about this much
    #: plus 64 KiB in the process, where autotuning would queue megabytes per socket.
    stream_send_buffer_bytes: int = Field(64 * 1024, ge=4096, le=16 * 1024 * 1024)
    #: Changes a push stream may fall behind by before it is sent a snapshot instead.
    stream_backlog: int = Field(1024, ge=16, le=100_000)
    #: GET /metrics is rendered at most once per this many seconds, whatever the scrape
    #: rate: a scrape sooner after the last rendering waits for (and shares) the next one,
    #: so it never gets a text older than itself (0: every scrape renders).
    metrics_cache_s: float = Field(1.0, ge=0, le=60)
    #: A second listener serving ``GET /metrics`` only (service/api/metrics_listener.py):
    #: the sidecar's, on the pod IP while the main listener stays on loopback. None: off.
    metrics_host: str | None = None
    #: Its port (0: any free port, for tests). Not 9464, the OpenTelemetry exporter's, which
    #: a producer in the same pod (one network namespace) may well use.
    metrics_port: int = Field(9188, ge=0, le=65535)
    #: Tokens that may scrape it (the tokens-file format; ``metrics`` or ``admin`` roles).
    #: None: the main listener's tokens; with neither, a non-loopback ``metrics_host``
    #: refuses to start unless ``allow_open``.
    metrics_tokens_file: str | None = None
    #: Broker names that get series of their own on this process's counters (first come);
    #: later names count under ``broker="_other"``. The table's gauges list as many
    #: brokers per namespace, avoided ones first.
    metrics_max_brokers: int = Field(1000, ge=1, le=100_000)
    #: Topics whose round-robin position a replica keeps (least recently selected
    #: dropped first; a dropped topic restarts at a random queue, like a new replica).
    max_topic_counters: int = Field(10_000, ge=1, le=10_000_000)
