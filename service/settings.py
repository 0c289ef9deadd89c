"""Process configuration, read once from flags and DETOUR_* environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


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
    redis_url: str | None = None
    #: A file holding the Redis password (a mounted Secret), read once at start and
    #: applied to ``redis_url``'s connections, so the URL (a ConfigMap, a flag) carries no
    #: secret. The URL's user, if any, is the ACL user it authenticates as
    #: (``redis://detour@redis:6379/0``); a URL that already has a password is refused.
    #: One trailing newline is ignored.
    redis_password_file: str | None = None
    workers: int = Field(1, ge=1, le=64)
    #: Every Redis key is ``{prefix}:{namespace}:...`` with the namespace as the
    #: Cluster hash tag, so one namespace's keys live in one slot.
    redis_prefix: str = Field("detour", pattern=r"^[A-Za-z0-9_.-]{1,32}$")
    namespace: str = Field("default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    #: How often a replica checks the table version in Redis: the bound on how
    #: long a missed push can go unnoticed (seconds).
    sync_interval_s: float = Field(1.0, gt=0, le=60)
    #: Redis socket timeout for sync, snapshots and admin writes (seconds).
    redis_timeout_s: float = Field(1.0, gt=0, le=60)
    #: Timeout of a report's Redis call (seconds): past it the report goes to the journal.
    redis_call_timeout_s: float = Field(0.05, gt=0, le=60)
    #: Reports the journal holds while Redis is unreachable; when full the oldest is dropped.
    journal_max: int = Field(100_000, ge=1, le=10_000_000)
    #: Largest request body accepted (bytes); larger ones get 413.
    max_body_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024)
    #: The same for POST /report-latency:batch (up to 1,000 reports).
    max_batch_body_bytes: int = Field(256 * 1024, ge=1024, le=16 * 1024 * 1024)
    #: Reports kept in the latency log (a Redis stream, trimmed approximately); 0 = no log.
    latency_log_max: int = Field(100_000, ge=0, le=10_000_000)
    #: How long a replica may sum the reports that change no window (docs/semantics.md)
    #: before it writes them (their brokers' latest latency and one latency-log histogram
    #: per broker) to the store; 0 = every report written at once, as one script call.
    report_flush_ms: int = Field(1000, ge=0, le=60_000)
    #: Events kept in the event log (windows opened, extended, ended early; a Redis stream,
    #: trimmed approximately); 0 = no log.
    events_max: int = Field(10_000, ge=0, le=1_000_000)
    #: Seconds SIGTERM waits for requests in flight (an open push stream is cut after it).
    shutdown_grace_s: int = Field(5, ge=0, le=300)
    #: Requests being handled at once before new ones get 503 SYSTEM_BUSY; the first
    #: such refusal also starts shedding (``turn_budget_ms``). The default never refuses
    #: a few hundred producers that each wait for their answer.
    max_in_flight: int = Field(256, ge=1, le=100_000)
    #: A request that waited longer than this (ms) before being served gets 503 SYSTEM_BUSY
    #: (RocketMQ's waitTimeMillsInSendQueue).
    max_queue_wait_ms: float = Field(200.0, ge=0, le=60_000)
    #: While shedding (from the first refusal until 1 s after the last), each turn of the
    #: event loop starts only as many requests as keep its CPU time near this (ms), and
    #: refuses the rest at once: refusals then wait at most about one such turn. 0 = off
    #: (the in-flight bound alone). docs/reliability.md, "Overload".
    turn_budget_ms: float = Field(0.5, ge=0, le=1_000)
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
    max_brokers: int = Field(10_000, ge=1, le=1_000_000)
