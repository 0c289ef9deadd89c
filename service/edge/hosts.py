"""Which Host names a request may carry: against DNS rebinding.

A web page whose own name resolves to 127.0.0.1 can drive an open Detour on loopback and,
the name being its own, read the answers. It always sends its name as Host, never an IP
literal, so (docs/security.md, "The HTTP edge") a Host must be a loopback name, an IP
literal or a configured name; anything else is answered 421 and the connection closed
(service/edge/protocol.py, and the fast refusal path, which leaves a foreign Host to it).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable

#: ``uri-host [ ":" port ]`` (RFC 9110 section 7.2, RFC 3986 section 3.2.2): an IP literal
#: in brackets, or a reg-name (an IPv4 address is one too), then at most a port.
_HOST_SYNTAX = re.compile(
    rb"(?:\[[0-9A-Za-z:._~!$&'()*+,;=-]+\]|(?:[0-9A-Za-z._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*)"
    rb"(?::[0-9]*)?"
)


#: How many Host values each verdict remembers (``remembered``).
REMEMBERED = 256


def remembered(judge: Callable[[bytes], bool]) -> tuple[Callable[[bytes], bool], dict[bytes, bool]]:
    """``judge`` with its verdicts kept for the values seen last, and what is kept. Every
    request asks, and a producer sends the same Host each time: a lookup instead of a
    parse on the select's path. Cleared when full, so a client sending a new value each
    time costs what it did without it, and memory stays bounded whatever the values."""
    seen: dict[bytes, bool] = {}

    def lookup(value: bytes) -> bool:
        verdict = seen.get(value)
        if verdict is None:
            if len(seen) >= REMEMBERED:
                seen.clear()
            verdict = seen[value] = judge(value)
        return verdict

    return lookup, seen


def _host_syntax(value: bytes) -> bool:
    """Whether a Host header value is ``host[:port]`` at all (RFC 9112 section 3.2: a
    server answers 400 to one that is not). Empty is valid: a target without an authority.
    Spaces, a user (``u@h``), a path or a second colon are not."""
    return _HOST_SYNTAX.fullmatch(value.strip(b" \t")) is not None


#: ``_host_syntax``, remembered.
valid_host, _syntax_seen = remembered(_host_syntax)


def _port_ok(port: str) -> bool:
    return port == "" or (port.isascii() and port.isdigit())


def _host_name(value: bytes) -> str:
    """The name of a Host header value, without its port, lower case; "" (allowed by
    nothing) when what follows the name is not a port (``[::1]evil.com``)."""
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):
        end = host.find("]")
        rest = host[end + 1 :]
        if end < 0 or (rest and not (rest[0] == ":" and _port_ok(rest[1:]))):
            return ""
        return host[1:end]
    if host.count(":") != 1:
        return host  # no port, or an unbracketed IPv6 literal
    name, _, port = host.partition(":")
    return name if _port_ok(port) else ""


def origin_path(target: bytes) -> bytes:
    """The path of a request target, in either form (``/select?x``, ``http://h/select``)."""
    if target[:1] == b"/":  # the origin form: every producer's request
        return target.partition(b"?")[0].partition(b"#")[0]
    if authority(target) is not None:
        rest = target.partition(b"://")[2]
        slash = rest.find(b"/")
        target = rest[slash:] if slash >= 0 else b"/"
    return target.partition(b"?")[0].partition(b"#")[0]


def authority(target: bytes) -> bytes | None:
    """The host of an absolute-form request target (``http://host:port/path``), which a
    server must judge instead of the Host header (RFC 9112 section 3.2.2); None for the
    origin form. With user information (``user@host``) it is ``b""``: allowed by nothing."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return None
    end = len(rest)
    for stop in (b"/", b"?", b"#"):
        at = rest.find(stop)
        if 0 <= at < end:
            end = at
    host = rest[:end]
    return b"" if b"@" in host else host


def _any(value: bytes) -> bool:
    return True


class HostNames:
    """Which Host names requests may carry: loopback names (``localhost``, ``*.localhost``),
    any IP literal (a rebinding page always sends a name: its own), and the configured
    names; ``*`` allows any."""

    def __init__(self, configured: Iterable[str]) -> None:
        names = {n.strip().lower().rstrip(".") for n in configured if n.strip()}
        self.any = "*" in names
        self.names = frozenset(names - {"*"})
        #: Whether a Host value names an allowed host; remembered (``remembered``:
        #: parsing it, an IP literal mostly, is a visible share of a select's cost).
        self.allows: Callable[[bytes], bool]
        self.allows, self._seen = remembered(_any if self.any else self._judge)

    @classmethod
    def parse(cls, setting: str | None, bind_host: str) -> HostNames:
        """From ``DETOUR_ALLOWED_HOSTS`` (comma-separated) plus the bound host, if a name."""
        return cls([*(setting or "").split(","), bind_host])

    def _judge(self, value: bytes) -> bool:
        name = _host_name(value).rstrip(".")
        if not name:
            return False
        if name == "localhost" or name.endswith(".localhost") or name in self.names:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True
