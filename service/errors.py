"""Detour's errors: plain Python, so any layer may raise them; the API renders them.

    DetourError                 base; carries an HTTP status and a stable code
    ├── NotFound                404 NOT_FOUND: no route for the topic, no such fault item
    ├── TableFull               409 TABLE_FULL: a new broker, and the table is full
    ├── ReportIdReused          422 REPORT_ID_REUSED: a reportId seen with other content
    ├── StoreUnavailable        503 STORE_UNAVAILABLE: Redis did not answer
    └── Busy                    503 SYSTEM_BUSY: a namespace's batch waited too long for
                                its turn (the shedder's own refusals are the edge's)

Other codes are answered without an exception of this tree: 422 VALIDATION_ERROR and
404/405 from the framework (service/api/errors.py, which also renders the body guards'
``BadBody``: 413 PAYLOAD_TOO_LARGE, 422 for a repeated key); and by the HTTP edge
(service/edge/) before any handler runs: 400 BAD_REQUEST (a request the HTTP parser
refuses), 401 UNAUTHORIZED and 403 FORBIDDEN (the token guard), 408, 413 by
Content-Length, 415, 421 and 431 (the edge's bounds), 503 SYSTEM_BUSY with Retry-After
(the shedder).

Every error response is ``{"error": CODE, "message": str, "field": str | null}``.
"""

from __future__ import annotations

from typing import Any


class DetourError(Exception):
    status = 500
    code = "INTERNAL"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class NotFound(DetourError):
    status = 404
    code = "NOT_FOUND"


class TableFull(DetourError):
    """A report named a broker the namespace's table has no room for (``max_brokers``
    items, every window still open): the whole request changed nothing."""

    status = 409
    code = "TABLE_FULL"

    def __init__(self, namespace: str, cap: int) -> None:
        super().__init__(
            f"the fault table of namespace {namespace!r} holds {cap} brokers with open "
            "windows: a report for a new broker is refused until one ends",
            field="brokerName",
        )
        self.namespace = namespace


class ReportIdReused(DetourError):
    """A report carries a ``reportId`` its scope (the token, or the open deployment) already
    used for a report with other content: the whole request changed nothing. As with an
    idempotency key reused with other parameters (IETF's Idempotency-Key draft: 422)."""

    status = 422
    code = "REPORT_ID_REUSED"

    def __init__(self, report_id: str, index: int) -> None:
        super().__init__(
            f"reportId {report_id!r} was used for a report with other content in the last 15 "
            "minutes: a report id names one report",
            field="reportId",
        )
        self.report_id = report_id
        self.index = index


class StoreUnavailable(DetourError):
    status = 503
    code = "STORE_UNAVAILABLE"


class Busy(DetourError):
    """Refused for now, to be retried after ``Retry-After`` (1 s): the SDK decides locally
    and queues its reports meanwhile."""

    status = 503
    code = "SYSTEM_BUSY"


def error_body(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    """The Error schema's one shape, for the handlers and the guards that answer before them."""
    return {"error": code, "message": message, "field": field}
