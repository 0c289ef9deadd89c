"""What a request head must be for Detour to serve it at all: one rule, for both lanes.

The HTTP parser (llhttp, through httptools) accepts more than Detour serves, and what it
accepts past HTTP/1.1's plain requests had each its own fault (docs/security.md, "The HTTP
edge"):

* **a protocol upgrade** (``Connection: upgrade`` with ``Upgrade: websocket`` or ``h2c``,
  or ``CONNECT``): the parser stops at the head and treats what follows as another
  protocol, so a body after it was lost and the connection hung; uvicorn handed WebSocket
  upgrades to its WebSocket protocol, which answered in plain text, and crashed on them
  while the edge was shedding. Detour speaks no other protocol;
* **a version other than HTTP/1.0 or HTTP/1.1** (``HTTP/2.0`` written as text, a
  version-less HTTP/0.9 line): served as if it were HTTP/1.1;
* **more than one Host**: only the first was checked against the allowed names (RFC 9112
  section 3.2: 400);
* **an HTTP/1.1 request without a Host, or with one that is not ``host[:port]``**
  (``a b``, ``user@host``): served, since the Host check let a missing Host through as
  HTTP/1.0's and the probes take any Host (RFC 9112 section 3.2: 400). HTTP/1.0 needs none.

Each is refused here, when the head is complete and before anything else looks at it, as
a request the parser refuses is: ``400 BAD_REQUEST`` in the Error shape, and the
connection closed (``EdgeProtocol`` raises ``HeadRefused`` inside the parser's callback,
so the parser stops and its error path answers, in order behind any answer under way).
"""

from __future__ import annotations

from collections.abc import Iterable

from service.edge.hosts import valid_host

#: The versions Detour serves.
VERSIONS = frozenset({"1.0", "1.1"})


class HeadRefused(Exception):
    """A head Detour does not serve: why (the 400's message), and the part that says so."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.field = field


def refusal(
    version: str, upgrade: bool, method: bytes, headers: Iterable[tuple[bytes, bytes]]
) -> HeadRefused | None:
    """Why this head is not served, or None. ``upgrade``: the parser saw an upgrade
    (``Connection: upgrade`` with ``Upgrade``, or ``CONNECT``)."""
    if version not in VERSIONS:
        return HeadRefused(f"HTTP/{version} is not served: HTTP/1.1 (or 1.0) only", None)
    if upgrade:
        if method == b"CONNECT":
            return HeadRefused("CONNECT is not served: Detour is not a proxy", None)
        return HeadRefused(
            "protocol upgrades (Upgrade: websocket, h2c) are not served: HTTP/1.1 only",
            "Upgrade",
        )
    hosts = 0
    for name, value in headers:
        if name == b"host":
            hosts += 1
            if hosts > 1:
                return HeadRefused("more than one Host header", "Host")
            if not valid_host(value):
                return HeadRefused("the Host header is not host[:port]", "Host")
    if hosts == 0 and version == "1.1":
        return HeadRefused("an HTTP/1.1 request needs a Host header", "Host")
    return None
