"""What the server protocol reads from the app's lifespan state: the edge's bounds and parts.

uvicorn builds one protocol object per connection and hands it the lifespan state, so
the process's edge (its settings, shedder, connection table, direct lane, outbox) lives
there under ``EDGE_STATE``, put by service/app.py; the protocol has no global of its own,
and without an ``Edge`` it behaves as uvicorn's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.auth import TokenTable
from service.edge.connections import ConnectionTable
from service.edge.direct import DirectLane
from service.edge.hosts import HostNames
from service.edge.outbox import Outbox
from service.edge.shedding import Shedder

#: The lifespan state key holding this process's ``Edge``.
EDGE_STATE = "edge"


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """The protocol's bounds (the settings of the same names)."""

    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    #: The largest body any route takes (``max_batch_body_bytes``): what follows a head,
    #: chunk framing and trailers included, may be at most twice this plus the head bound
    #: (``EdgeProtocol``), since the parser holds a trailer's value whole.
    max_body_bytes: int = 256 * 1024
    header_timeout_s: float = 5.0
    body_timeout_s: float = 5.0
    max_connections: int = 512
    max_connections_per_peer: int = 256
    #: A connection that has not proven itself (no valid token shown; on an open Detour,
    #: no request served) may be idle this long (s).
    unproven_idle_s: float = 1.0
    #: Kernel send and receive buffers of every connection's socket
    #: (``socket_buffer_bytes``): fixed, so that no client makes the kernel queue
    #: megabytes for one connection.
    socket_buffer: int = 64 * 1024
    #: Kernel send buffer of an endless response's socket (``stream_send_buffer_bytes``):
    #: fixed, so a client that stops reading stalls the writes after this much, where
    #: autotuning would queue megabytes.
    stream_send_buffer: int = 64 * 1024
    #: The Host names requests may carry; None: any (not checked).
    hosts: HostNames | None = None


@dataclass(slots=True)
class Edge:
    """The process's edge, as the protocol finds it."""

    limits: EdgeLimits
    shedder: Shedder | None = None
    #: The hot routes answered without ASGI when they never wait (service/edge/direct.py).
    direct: DirectLane | None = None
    #: With tokens, a connection proves itself with a valid one (``EdgeLimits.unproven_idle_s``).
    tokens: TokenTable | None = None
    outbox: Outbox = field(default_factory=Outbox)
    connections: ConnectionTable = field(init=False)
    #: Requests whose head was read (a report batch paces itself while others arrive:
    #: service/api/pacing.py).
    requests_read: int = 0

    def __post_init__(self) -> None:
        self.connections = ConnectionTable(
            self.limits.max_connections, self.limits.max_connections_per_peer
        )
