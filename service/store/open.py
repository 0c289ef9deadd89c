"""Choose the store: Redis when a URL is configured, else the embedded memory store."""

from __future__ import annotations

from service.settings import Settings
from service.store.base import FaultStore
from service.store.memory import MemoryStore


async def open_store(settings: Settings) -> FaultStore:
    store: FaultStore
    if settings.redis_url:
        from service.store.redis import RedisStore

        store = RedisStore(settings)
    else:
        store = MemoryStore(settings.latency_log_max, settings.events_max)
    await store.start()
    return store
