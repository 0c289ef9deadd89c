"""report.lua and the other store scripts called directly, as RedisStore calls them: the
ARGV layout each script's header documents, built in one place for the tests."""

from __future__ import annotations

from typing import Any

import redis

from detour import policy
from detour.apply import ReportIn
from detour.model import Config, FaultItem
from service.store import codec, scripts
from service.store.redis import _policy_arg, _vote, integrity_arg

PREFIX = "detour:{default}"
#: report.lua's KEYS, in its header's order
REPORT_KEYS = [f"{PREFIX}:{k}" for k in ("faults", "meta", "latency-log", "events", "ends",
                                         "writers", "writers-seen", "ids", "ids-index",
                                         "ids-forgotten", "routes", "graves")]
CHANNEL = f"{PREFIX}:changes"


def script(raw: redis.Redis, name: str) -> Any:
    """A store script as Redis runs it (its library prepended)."""
    return raw.register_script(scripts.source(name))


def head(config: Config, *, config_stamp: int = 0, epoch: str = "", writer: str = "test",
         acked: int = 0, floor: int = 0, cap: int = 10_000, log_cap: int = 1000,
         events: int = 0, base: int | str = "") -> list[Any]:
    """report.lua's ARGV[1..11] (``base`` "": the ages are from the script's own now)."""
    enabled = config.send_latency_fault_enable
    rule = ("overwrite" if config.last_report_wins else "extend") if enabled else "off"
    return [config_stamp, rule, CHANNEL, log_cap, cap, _policy_arg(config, events), epoch,
            writer, integrity_arg(acked), floor, base]


def entry(config: Config, r: ReportIn, jitter_roll: int = 0) -> list[Any]:
    """report.lua's fourteen values for one report (RedisStore._report_args's)."""
    enabled = config.send_latency_fault_enable
    if not enabled:
        t = None
    elif r.pending:
        t = policy.pending_tier(config, r.latency_ms) if config.pending_quorum else None
    else:
        from detour import strategy

        t = strategy.tier(config, r.latency_ms, r.isolation)
    duration = 0 if t is None else config.not_available_duration[t]
    return [r.broker_name, r.latency_ms, duration, r.age_ms, int(r.isolation and not r.pending),
            r.producer, _vote(config, r, duration), jitter_roll,
            "" if t is None else config.latency_max[t], r.voter_id, r.seq, r.report_id, r.scope,
            r.fingerprint if r.report_id else ""]


def unstamped(value: str) -> str:
    """A stored item without its stamp (the stamp is the script's, not the rule's)."""
    return value.split("@", 1)[1] if "@" in value.split(";", 1)[0] else value


def stored_form(item: FaultItem) -> str:
    """The form the scripts store ``item`` in, without its stamp."""
    return unstamped(codec.encode_fault(item))
