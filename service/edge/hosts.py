"""Which Host names a request may carry: against DNS rebinding.

A web page whose own name resolves to 127.0.0.1 can drive an open Detour on loopback and,
the name being its own, read the answers. It always sends its name as Host, never an IP
literal, so (docs/security.md, "The HTTP edge") a Host must be a loopback name, an IP
literal or a configured name; anything else is answered 421 and the connection closed
(service/edge/protocol.py, and the fast refusal path, which leaves a foreign Host to it).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable


def _host_name(value: bytes) -> str:
    """The name of a Host header value, without its port, lower case."""
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostNames:
    """Which Host names requests may carry: loopback names (``localhost``, ``*.localhost``),
    any IP literal (a rebinding page always sends a name: its own), and the configured
    names; ``*`` allows any."""

    def __init__(self, configured: Iterable[str]) -> None:
        names = {n.strip().lower().rstrip(".") for n in configured if n.strip()}
        self.any = "*" in names
        self.names = frozenset(names - {"*"})
        #: Host value -> verdict, for the values seen last: a producer's connections send
        #: the same Host on every request, and parsing it (an IP literal, mostly) is a
        #: visible share of a select's cost. Cleared when full, so a client sending a new
        #: Host each time costs what it did without it, and memory stays bounded.
        self._verdicts: dict[bytes, bool] = {}

    #: How many Host values ``allows`` remembers.
    REMEMBERED = 256

    @classmethod
    def parse(cls, setting: str | None, bind_host: str) -> HostNames:
        """From ``DETOUR_ALLOWED_HOSTS`` (comma-separated) plus the bound host, if a name."""
        return cls([*(setting or "").split(","), bind_host])

    def allows(self, value: bytes) -> bool:
        if self.any:
            return True
        verdict = self._verdicts.get(value)
        if verdict is None:
            if len(self._verdicts) >= self.REMEMBERED:
                self._verdicts.clear()
            verdict = self._verdicts[value] = self._judge(value)
        return verdict

    def _judge(self, value: bytes) -> bool:
        name = _host_name(value).rstrip(".")
        if name == "localhost" or name.endswith(".localhost") or name in self.names:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True
