"""Who a request is from and which table it reads: what routes take from the request itself.

With tokens, the token guard (service/edge/guard.py) records the caller's principal in
the request's state and points ``store`` at its namespace's table; without, every
request is on the open namespace's table and the producer id a body gives is taken as
it is. The direct lane (service/edge/direct.py) asks the same questions with the same
functions.
"""

from __future__ import annotations

from typing import Any

from service.auth import Principal


def principal_of(state: dict[str, Any]) -> Principal | None:
    principal: Principal | None = state.get("principal")
    return principal


def reporter(principal: Principal | None, given: str | None) -> str:
    """Who made a report: with tokens, the token's name, then ``/`` and the producer id
    the request gave, so one token's holder cannot report as another's producers."""
    if principal is None:
        return given or ""
    return f"{principal.name}/{given}" if given else principal.name


def voter(principal: Principal | None, given: str | None) -> str:
    """Who the isolation quorum counts a producer as: with tokens, the token's name alone
    (a holder cannot vote as many producers by varying ``producer``); else the id given."""
    return principal.name if principal is not None else given or ""
