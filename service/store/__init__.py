"""Storage of the shared fault table: the only package that knows Redis."""

from service.store.base import FaultStore, ReportIn, ReportOutcome
from service.store.open import open_store

__all__ = ["FaultStore", "ReportIn", "ReportOutcome", "open_store"]
