"""What the stores need to know, as a value of their own: the stores never read Settings.

The app builds it from its Settings (``StoreOptions.of(settings)``), so the store layer
depends on no configuration machinery and a test can build one directly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """What the stores read, declared once: these defaults are the Settings fields' of the
    same names (service/settings.py takes them from here and adds bounds and the
    environment), so a default changes in one place."""

    redis_url: str | None = None
    redis_prefix: str = "detour"
    namespace: str = "default"
    redis_timeout_s: float = 1.0
    redis_call_timeout_s: float = 0.05
    journal_max: int = 100_000
    latency_log_max: int = 100_000
    events_max: int = 10_000
    max_brokers: int = 10_000
    sync_interval_s: float = 1.0
    report_flush_ms: int = 1000
    #: the config a new table starts with (detour/profiles.py)
    profile: Literal["recommended", "rocketmq-4"] = "recommended"

    @classmethod
    def of(cls, source: object) -> StoreOptions:
        """The options from any object with these attributes (the app's Settings)."""
        if isinstance(source, StoreOptions):
            return source
        return cls(**{f.name: getattr(source, f.name) for f in fields(cls)})
