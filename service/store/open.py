"""Choose the store: Redis when a URL is configured, else the embedded memory store."""

from __future__ import annotations

from service.settings import Settings
from service.store.base import FaultStore
from service.store.connect import read_password_file, with_password
from service.store.memory import MemoryStore


def with_redis_password(settings: Settings) -> Settings:
    """The settings with ``redis_password_file``'s password in the Redis URL, read now.

    Called once at start (the process, then each worker's app); the copy has no file
    left, so applying it twice reads nothing twice. Raises ``ValueError`` naming the
    setting: an unreadable or empty file, a URL that has a password already, or a file
    without a Redis URL to apply it to.
    """
    if not settings.redis_password_file:
        return settings
    if not settings.redis_url:
        raise ValueError("DETOUR_REDIS_PASSWORD_FILE is set but DETOUR_REDIS_URL is not")
    password = read_password_file(settings.redis_password_file)
    return settings.model_copy(
        update={
            "redis_url": with_password(settings.redis_url, password),
            "redis_password_file": None,
        }
    )


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
