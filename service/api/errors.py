"""The handlers that render every error, raised or from the framework, as the Error schema."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic.alias_generators import to_camel
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from service.errors import Busy, DetourError, error_body

log = logging.getLogger("detour")


class BadBody(HTTPException):
    """A body refused before its model: a repeated key (422) or a streamed body past its
    limit (413), naming the field. An HTTPException, so that it passes through FastAPI's
    body reading to the handler below (anything else raised there becomes a 400)."""

    def __init__(self, status: int, message: str, field: str) -> None:
        super().__init__(status, message)
        self.field = field


_HTTP_CODES = {
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    413: "PAYLOAD_TOO_LARGE",
    415: "UNSUPPORTED_MEDIA_TYPE",
    422: "VALIDATION_ERROR",
}


def field_path(loc: Sequence[int | str]) -> str:
    """``("body", "brokers", 0, "writeQueueNums")`` -> ``brokers[0].writeQueueNums``.

    A whole-body problem (malformed JSON, missing body) is named ``body``.
    """
    parts = list(loc)
    if parts and parts[0] in ("body", "path", "query", "header"):
        parts = parts[1:] if len(parts) > 1 else parts
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            # A default that failed a rule across fields is located by its Python name:
            # say its wire name (every body field is the camelCase of its name).
            p = to_camel(p) if "_" in p else p
            out += f".{p}" if out else str(p)
    return out or "body"


_TEMPLATE_PARAM = re.compile(r"\\\{[^/]+?\\\}")


def allowed_methods(request: Request) -> str:
    """The methods the API documents at this path, for ``Allow`` on a 405: all of them
    (RFC 9110), where the router names only those of the first route it met. Matched as
    OpenAPI does: a concrete path (``/fault-items/stream``) before templated ones
    (``/fault-items/{brokerName}``)."""
    path = request.scope["path"]
    paths: dict[str, dict[str, Any]] = request.app.openapi()["paths"]
    item = paths.get(path)
    if item is None:
        for template, candidate in paths.items():
            if re.fullmatch(_TEMPLATE_PARAM.sub("[^/]+", re.escape(template)), path):
                item = candidate
                break
    return ", ".join(sorted(m.upper() for m in item or {} if m != "parameters"))


def _validation_message(err: dict[str, Any]) -> str:
    if err.get("type") == "json_invalid":
        # The parser's reason says where (a number out of range: its line and column).
        reason = (err.get("ctx") or {}).get("error")
        return "request body is not valid JSON" + (f" ({reason})" if reason else "")
    return str(err.get("msg", "invalid value"))


def install_error_handlers(app: FastAPI) -> None:
    async def on_detour_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, DetourError)
        headers = {"Retry-After": "1"} if isinstance(exc, Busy) else None
        return JSONResponse(
            error_body(exc.code, exc.message, exc.field), status_code=exc.status, headers=headers
        )

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = list(exc.errors())
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
        loc = first.get("loc", ("body",))
        if first.get("type") == "json_invalid":
            loc = ("body",)
        field = field_path(loc)
        return JSONResponse(
            error_body("VALIDATION_ERROR", f"{field}: {_validation_message(first)}", field),
            status_code=422,
        )

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        if isinstance(exc, BadBody):
            code = _HTTP_CODES.get(exc.status_code, "HTTP_ERROR")
            return JSONResponse(error_body(code, exc.detail, exc.field), exc.status_code)
        if exc.status_code == 400:
            # The framework's answer to a body json.loads choked on in a way it does
            # not classify (a 5,000-digit number, nesting past the recursion limit).
            # The parser stopped before it knew which field: the body is named.
            body = error_body(
                "VALIDATION_ERROR",
                "request body is not valid JSON (a number of more than 4,300 digits, or "
                "nesting too deep)",
                "body",
            )
            return JSONResponse(body, status_code=422)
        code = _HTTP_CODES.get(exc.status_code, "HTTP_ERROR")
        field = "body" if exc.status_code == 413 else None
        headers = exc.headers
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": allowed_methods(request)}
        return JSONResponse(
            error_body(code, str(exc.detail), field),
            status_code=exc.status_code,
            headers=headers,
        )

    async def on_disconnect(_: Request, exc: Exception) -> Response:
        # The client left (or the body deadline closed it) while its body was read:
        # nobody is there to answer, and it is no error of Detour's.
        return Response(status_code=499)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Never leak a traceback; the log has it.
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(error_body("INTERNAL", "internal error"), status_code=500)

    app.add_exception_handler(DetourError, on_detour_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnect, on_disconnect)
    app.add_exception_handler(Exception, on_unexpected)
