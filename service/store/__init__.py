"""Storage of the shared fault table: the only package that knows Redis."""

from service.store.base import FaultStore, LogEntry, ReportIn, ReportOutcome
from service.store.open import open_store, with_redis_password
from service.store.options import StoreOptions

__all__ = [
    "FaultStore",
    "LogEntry",
    "ReportIn",
    "ReportOutcome",
    "StoreOptions",
    "open_store",
    "with_redis_password",
]
