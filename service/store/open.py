"""Choose the store: Redis when a URL is configured, else the embedded memory store."""

from __future__ import annotations

from service.settings import Settings
from service.store.base import FaultStore
from service.store.memory import MemoryStore


async def open_store(settings: Settings, namespace: str | None = None) -> FaultStore:
    """The store of one namespace (``settings.namespace`` when None)."""
    namespace = namespace or settings.namespace
    store: FaultStore
    if settings.redis_url:
        from service.store.redis import RedisStore

        store = RedisStore(settings, namespace)
    else:
        store = MemoryStore(
            settings.latency_log_max, namespace, settings.max_brokers, settings.events_max
        )
    await store.start()
    return store
