"""Choose the store: Redis when a URL is configured, else the embedded memory store."""

from __future__ import annotations

from typing import Any, Protocol, Self, TypeVar

from detour.profiles import PROFILES
from service.store.base import FaultStore
from service.store.connect import read_password_file, with_password
from service.store.memory import MemoryStore
from service.store.options import StoreOptions


class _RedisSettings(Protocol):
    """The part of the app's Settings the password file concerns (pydantic's model_copy)."""

    redis_url: str | None
    redis_password_file: str | None

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Self: ...


_S = TypeVar("_S", bound=_RedisSettings)


def with_redis_password(settings: _S) -> _S:
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


async def open_store(options: StoreOptions | object, namespace: str | None = None) -> FaultStore:
    """The store of one namespace (``options.namespace`` when None); ``options``: a
    StoreOptions, or the app's Settings it is built from."""
    settings = StoreOptions.of(options)
    namespace = namespace or settings.namespace
    store: FaultStore
    if settings.redis_url:
        from service.store.redis import RedisStore

        store = RedisStore(settings, namespace)
    else:
        store = MemoryStore(
            settings.latency_log_max,
            namespace,
            settings.max_brokers,
            settings.events_max,
            PROFILES[settings.profile],
        )
    await store.start()
    return store
