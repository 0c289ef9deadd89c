"""schemathesis hooks for the CLI run in tests/test_schemathesis.py (``SCHEMATHESIS_HOOKS``)."""

from __future__ import annotations

import itertools
import re
import uuid
from typing import Any
from urllib.parse import quote, unquote

import schemathesis
from schemathesis.core.parameters import ParameterLocation
from schemathesis.generation.modes import GenerationMode

from service.schemas import NAME_PATTERN

_NAME = re.compile(NAME_PATTERN)
#: Fresh report ids: a reportId names one report, so the same id with other content is
#: refused (422 REPORT_ID_REUSED), a rule of the service's state that no schema can express.
#: Generated bodies reuse the contract's example id with other content; each case gets ids
#: of its own instead.
_IDS = itertools.count()
#: schemathesis may run several workers, each importing these hooks: ids of each its own
_RUN = uuid.uuid4().hex[:12]


def as_path_segment(value: str) -> str:
    """The path segment that names ``value``, a name meant to be valid.

    `%` is allowed in names (as in RocketMQ's ``%RETRY%`` topics), which schemathesis's path
    quoting does not expect: it decodes a value before encoding it ("to keep quoting
    idempotent"), and the stateful phase copies names read from response bodies into paths
    as they are. Either way a broker named ``Vna%1Ey`` reaches the service as ``Vna<0x1E>y``
    and is refused, a client bug rather than the service's. A value that matches the name
    pattern only before decoding is a raw name, so it is encoded here.
    """
    if _NAME.match(value) and not _NAME.match(unquote(value)):
        return quote(value, safe="")
    return value


def prepare(case: Any) -> None:
    """What every case needs before it is sent (both runs of tests/test_schemathesis.py)."""
    # The active detector would TCP-connect to the brokers' addresses (10.0.0.x in the
    # contract's examples): tests send traffic to 127.0.0.1 only.
    if case.operation.path == "/config" and isinstance(case.body, dict):
        case.body["detectorEnable"] = False
    body = case.meta.components.get(ParameterLocation.BODY) if case.meta else None
    positive = body is None or body.mode is not GenerationMode.NEGATIVE
    if positive and case.operation.path.startswith("/report-latency") and isinstance(
        case.body, dict
    ):
        items = case.body.get("reports", [case.body])
        for item in items if isinstance(items, list) else ():
            if isinstance(item, dict) and isinstance(item.get("reportId"), str):
                item["reportId"] = f"st-{_RUN}-{next(_IDS)}"
    path = case.meta.components.get(ParameterLocation.PATH) if case.meta else None
    if path is not None and path.mode is GenerationMode.NEGATIVE:
        return  # an invalid name on purpose: it must reach the service as generated
    for name, value in (case.path_parameters or {}).items():
        if isinstance(value, str):
            case.path_parameters[name] = as_path_segment(value)


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    prepare(case)
