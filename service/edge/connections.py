"""Open connections, fairly: a cap per process and per peer, and idle ones make room.

A hard cap alone (Envoy's listener ``max_connections``) hands the process to whoever opens
connections first: one client holding 520 idle connections locked every other client out,
and one that sent nothing did so for the head deadline of each reconnect cycle. So
(docs/security.md, "The HTTP edge"):

* **Per peer** (``DETOUR_MAX_CONNECTIONS_PER_PEER``): one address may hold at most this
  many; its next connection is closed when accepted. One peer cannot take the process.
* **At the cap, idle connections make room** (``DETOUR_MAX_CONNECTIONS``): a new
  connection closes one that is between requests (nothing being read, answered or
  held). Chosen first among connections that have *not proven themselves* (no valid
  token shown; on an open Detour, no request let through yet), then from the peer holding
  the most connections, then the one idle longest. Only when every connection is busy is
  the new one refused. Closing an idle keep-alive connection costs its client a
  reconnect at worst, which every HTTP client does on its own.
* Connections that have not proven themselves also get a short idle timeout
  (``DETOUR_UNPROVEN_IDLE_S``, the protocol's), so they do not wait for eviction.
* **At the cap, with none idle, an unproven connection still reading its request** (a
  head or body not yet whole, nothing of it answered) makes room, the oldest first: each
  such hold was bounded by the read deadlines, but a client reconnecting after each 408
  from a few addresses kept every producer out for as long as it liked (95% of a
  producer's connects refused; a request refused 401 whose body never comes is one).
  A proven connection's request is never cut. (On an open Detour any complete head
  proves a connection: there is no identity to prove, and it listens on loopback.)

Pure bookkeeping: the protocol registers and unregisters each connection and says when
it is idle; ``ConnectionTable`` decides.
"""

from __future__ import annotations

import resource
from typing import Protocol


class Connection(Protocol):
    """What the table needs of a connection (the server protocol)."""

    #: the peer's address (its IP, without the port); "" when unknown
    peer: str
    #: it showed a valid token (on an open Detour: it had a request served)
    proven: bool

    def idle_since(self) -> float | None:
        """When it became idle (loop time), or None while a request is read, answered
        or held."""

    def reading_since(self) -> float | None:
        """For a connection that has not proven itself and is still reading a request
        (nothing of it answered): when that request began (loop time); else None."""

    def evict(self) -> None:
        """Close it to make room (it counts the eviction)."""


class ConnectionTable:
    """The open connections of one process, by peer."""

    def __init__(self, max_connections: int, max_per_peer: int) -> None:
        self.max_connections = max(1, max_connections)
        self.max_per_peer = max(1, min(max_per_peer, self.max_connections))
        self._open: set[Connection] = set()
        self._peers: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._open)

    def of_peer(self, peer: str) -> int:
        return self._peers.get(peer, 0)

    def admit(self, conn: Connection) -> str | None:
        """Register a new connection; None when it may stay (an idle one may have been
        evicted for it), else why it is refused: ``peer_connections`` (its peer holds
        its cap) or ``connections`` (the process is full and nothing is idle)."""
        if self.of_peer(conn.peer) >= self.max_per_peer:
            return "peer_connections"
        if len(self._open) >= self.max_connections:
            victim = self._victim()
            if victim is None:
                return "connections"
            self.remove(victim)
            victim.evict()
        self._open.add(conn)
        self._peers[conn.peer] = self._peers.get(conn.peer, 0) + 1
        return None

    def remove(self, conn: Connection) -> None:
        """Unregister a connection (closed, evicted); a second call does nothing."""
        if conn not in self._open:
            return
        self._open.discard(conn)
        left = self._peers[conn.peer] - 1
        if left:
            self._peers[conn.peer] = left
        else:
            del self._peers[conn.peer]

    def _victim(self) -> Connection | None:
        """The connection to close: an idle one, unproven first, then from the peer holding
        the most, then the one idle longest; with none idle, the unproven one reading a
        request the longest."""
        best: Connection | None = None
        best_key: tuple[bool, bool, int, float] | None = None
        for conn in self._open:
            idle = conn.idle_since()
            since = idle if idle is not None else conn.reading_since()
            if since is None:
                continue
            key = (conn.proven, idle is None, -self._peers[conn.peer], since)
            if best_key is None or key < best_key:
                best, best_key = conn, key
        return best


def connection_bound(wanted: int, reserve: int = 128) -> int:
    """``wanted`` connections, or fewer when the process may not open that many files
    (keeping ``reserve`` for Redis connections, logs and the listener). The soft limit is
    raised toward the hard one first, as nginx's ``worker_rlimit_nofile`` does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + reserve
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - reserve))
