"""Every answer the edge writes itself, built here: the Error shape as whole HTTP/1.1 bytes
or as ASGI messages, and the direct lane's answers.

Why one place: the edge answers before (or instead of) Detour's app in a dozen spots (the
parser's 400, the bounds' 408/421/431, the shedder's 503, the guard's 401/403, the body
guards' 413/415, the lane's answers), and each used to build its own bytes. The README
promises one JSON shape for every error (``{"error", "message", "field"}``,
``service.errors.error_body``); built once, it cannot drift.
"""

from __future__ import annotations

import http
import json
from collections.abc import Iterable, Sequence

from starlette.types import Message, Send

from service.errors import error_body

Header = tuple[bytes, bytes]
#: Every answer the edge writes is JSON.
JSON_TYPE: Header = (b"content-type", b"application/json")
CLOSE: Header = (b"connection", b"close")
#: The shedder's refusal: Retry-After tells a client (and the SDK's circuit) when to come back.
RETRY_AFTER: Header = (b"retry-after", b"1")
BUSY_MESSAGE = "overloaded: retry shortly or decide locally"


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


#: ``HTTP/1.1 200 OK\r\n`` and the others, as uvicorn writes them (tests/test_uvicorn_seam.py
#: compares the two tables).
STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}


def error_json(code: str, message: str, field: str | None = None) -> bytes:
    """The Error schema's body."""
    return json.dumps(error_body(code, message, field)).encode()


def whole(status: int, headers: Iterable[Header], payload: bytes) -> bytes:
    """A whole HTTP/1.1 answer: status line, ``headers`` as given, then ``payload``."""
    content = [STATUS_LINES[status]]
    for name, value in headers:
        content += (name, b": ", value, b"\r\n")
    content += (b"\r\n", payload)
    return b"".join(content)


def error_headers(body: bytes, extra: Sequence[Header] = ()) -> list[Header]:
    return [JSON_TYPE, (b"content-length", b"%d" % len(body)), *extra]


def raw_error(
    status: int,
    code: str,
    message: str,
    field: str | None = None,
    *,
    close: bool = True,
    extra: Sequence[Header] = (),
) -> bytes:
    """An error answer as the bytes the server protocol writes; ``close``: it says
    ``connection: close`` (the protocol then closes the connection)."""
    body = error_json(code, message, field)
    return whole(status, error_headers(body, (*extra, CLOSE) if close else extra), body)


def asgi_error(
    status: int, code: str, message: str, field: str | None = None, extra: Sequence[Header] = ()
) -> tuple[Message, Message]:
    """An error answer as the two ASGI messages a middleware sends."""
    body = error_json(code, message, field)
    return (
        {"type": "http.response.start", "status": status, "headers": error_headers(body, extra)},
        {"type": "http.response.body", "body": body},
    )


async def send_error(
    send: Send,
    status: int,
    code: str,
    message: str,
    field: str | None = None,
    extra: Sequence[Header] = (),
) -> None:
    """Send an error answer from ASGI middleware (the guards, the shedder)."""
    start, body = asgi_error(status, code, message, field, extra)
    await send(start)
    await send(body)


#: The shedder's 503, as the protocol writes it (keep-alive: the client may come back).
BUSY = raw_error(503, "SYSTEM_BUSY", BUSY_MESSAGE, close=False, extra=(RETRY_AFTER,))
#: The same as ASGI messages (a request the shedder refuses inside the app).
BUSY_MESSAGES = asgi_error(503, "SYSTEM_BUSY", BUSY_MESSAGE, extra=(RETRY_AFTER,))
