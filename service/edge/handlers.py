"""The app's exception handlers, found and run outside Starlette's middleware: the direct lane's.

The direct lane (service/edge/direct.py) answers without ASGI, but what its endpoints
raise must be answered as the ASGI way answers it: by the handler the app registered
(service/api/errors.py). Starlette keeps its own lookup private, so ``handler_for`` picks a
handler the way its exception middleware does, here only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import Response

log = logging.getLogger("detour.edge")

Handlers = Mapping[Any, Callable[..., Any]]


def handler_for(handlers: Handlers, exc: Exception) -> Callable[..., Any]:
    """The app's handler for ``exc`` as Starlette picks it: by status for HTTP errors
    (the exception middleware's), else by class, and the 500/``Exception`` one (the
    server-error middleware's) for anything else."""
    if isinstance(exc, HTTPException):
        found = handlers.get(exc.status_code)
        if found is not None and exc.status_code != 500:
            return found
    for cls in type(exc).__mro__:
        if cls is Exception:
            break
        found = handlers.get(cls)
        if found is not None:
            return found
    return handlers.get(500) or handlers[Exception]


def run_handler(handler: Callable[..., Any], request: Any, exc: Exception) -> Response | None:
    """The response ``handler`` builds for ``exc``, or None (logged) when it would wait.

    Detour's handlers are coroutines that never wait (they build a response): run to
    completion here, in the callback that read the request. One that did wait would be
    a bug of the lane's, answered as unexpected."""
    coro = handler(request, exc)
    try:
        coro.send(None)
    except StopIteration as done:
        result: Response = done.value
        return result
    coro.close()
    log.error("an exception handler waited; answered as unexpected")
    return None
