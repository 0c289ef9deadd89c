"""How much one connection may have read and not yet answered: the pipelining bound.

HTTP/1.1 lets a client send requests without waiting for answers. uvicorn parses every
byte it reads, so a client that pipelines and never reads its answers made one
connection hold millions of parsed requests (a ``GET /healthz`` pipeliner with a 4 KiB
receive buffer took the process from 63 to 412 MiB in 2.6 s; plain uvicorn does the
same). Stopping the socket is not enough: one read holds thousands of small requests,
and the parser parses all it is given. So the protocol gives the parser only as much of
a read as keeps it within the bound, holds the rest (at most one read) and stops reading
the socket until answers drain:

* at most ``MAX_UNANSWERED`` requests parsed and not answered (being handled, or queued
  behind one that is);
* at most ``MAX_WAITING_BYTES`` of answers written and not yet taken by the client, plus
  the bodies of requests queued behind the one being answered.

A request's head ends with the only empty line in it (``\\r\\n\\r\\n``: the parser accepts
no other line end), so counting empty lines bounds how many heads a slice of bytes
completes; one more may complete across a read boundary, which the next read then sees.
Pure: the protocol (service/edge/protocol.py) asks, and does the reading and holding.
"""

from __future__ import annotations

#: Requests a connection may have parsed and not answered.
MAX_UNANSWERED = 16
#: Bytes of answers not yet taken by the client, plus bodies of queued requests, past
#: which a connection's reading stops (the transport's own high-water mark).
MAX_WAITING_BYTES = 64 * 1024
#: The end of every request head.
HEAD_END = b"\r\n\r\n"


def room(unanswered: int, waiting_bytes: int) -> int:
    """How many more request heads may be parsed now (0: hold what is read)."""
    if waiting_bytes > MAX_WAITING_BYTES:
        return 0
    return max(0, MAX_UNANSWERED - unanswered)


def feedable(data: bytes, start: int, heads: int) -> int:
    """Where to stop giving ``data[start:]`` to the parser so that at most ``heads`` request
    heads complete in it: ``len(data)``, or the start of the (heads+1)-th head end (the
    parser then waits inside that head, which completes when it is given the rest).
    Overlapping empty lines count twice: a stop too early is safe, one too late is not."""
    pos = start - 1
    for _ in range(heads + 1):
        pos = data.find(HEAD_END, pos + 1)
        if pos < 0:
            return len(data)
    return pos
