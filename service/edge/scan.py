"""Whole simple requests found in raw bytes: what the shedder may refuse without the parser.

While the service sheds, a refusal through the parser's callbacks costs about a fifth of
a select, so at 5x overload refusals alone would eat the CPU (docs/BENCHMARKS.md,
"Overload"). The server protocol (``EdgeProtocol._refuse_fast``) therefore scans a read
for whole requests it may refuse from the bytes alone. It may take only what the parser
would accept *and* the edge would serve: anything else must reach the parser and the
edge's checks, so that a malformed request gets 400 and close, a foreign Host 421 and
close, while shedding as at any other time. So a simple request is, strictly:

* a request line with a method the parser knows (not HEAD: its answer has no body), an
  origin-form target of RFC 3986 path and query characters only, and ``HTTP/1.1``;
* header lines whose names are tokens and whose values are visible ASCII, spaces and
  tabs (no control characters, no obs-text), within the head byte and count bounds;
* no ``Transfer-Encoding``, ``Connection``, ``Expect`` or ``Upgrade`` (anywhere in the
  head: they change framing or the connection), ``Content-Length`` at most once;
* exactly one Host, ``host[:port]``, and when Host names are checked, one they allow;
* not a probe or scrape (never shed).

Stricter than the parser is safe (the request is parsed, then refused as usual); laxer
is the bug this module exists to avoid.
"""

from __future__ import annotations

import re

from service.edge.hosts import HostNames, valid_host

_SIMPLE_HEAD = re.compile(
    rb"(?:GET|POST|PUT|DELETE|OPTIONS|PATCH) "
    rb"(/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*)(?:\?[A-Za-z0-9._~!$&'()*+,;=:@%/?-]*)? HTTP/1\.1\r\n"
    rb"((?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e]*\r\n)*)\r\n"
)
#: Headers that change how a request is framed or whether the connection stays open: a
#: head carrying any of them (even inside a value) is left to the parser.
_NOT_SIMPLE = (b"transfer-encoding", b"connection", b"expect", b"upgrade")
# (A header's line start is looked behind, not consumed: the previous match took it.)
_CONTENT_LENGTH = re.compile(rb"(?:^|(?<=\n))content-length:[ \t]*([0-9]{1,12})[ \t]*\r\n")
_HOST = re.compile(rb"(?:^|(?<=\n))host:[ \t]*([^\r]*?)[ \t]*\r\n")


def simple_request(
    data: bytes,
    pos: int,
    max_header_bytes: int,
    max_headers: int,
    hosts: HostNames | None,
    exempt: frozenset[bytes],
) -> tuple[int, int]:
    """(end of its head, length of its body) of the simple request at ``data[pos:]``
    (its body may lie past ``data``), or (-1, 0) when what starts there is not one."""
    head = _SIMPLE_HEAD.match(data, pos, min(len(data), pos + max_header_bytes))
    if head is None or head.group(1) in exempt:
        return -1, 0
    fields = head.group(2).lower()
    if fields.count(b"\r\n") > max_headers or any(name in fields for name in _NOT_SIMPLE):
        return -1, 0
    names = _HOST.findall(fields)
    if len(names) != 1 or not valid_host(names[0]):
        return -1, 0  # none, two or a malformed one are refused 400 (heads.py)
    if hosts is not None and not hosts.allows(names[0]):
        return -1, 0  # a foreign one 421
    body = 0
    lengths = fields.count(b"content-length")
    if lengths:
        length = _CONTENT_LENGTH.search(fields)
        if lengths > 1 or length is None:
            return -1, 0
        body = int(length.group(1))
    return head.end(), body
