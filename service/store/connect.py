"""Redis URLs and the clients they open: one server, a Redis Cluster, or a Sentinel-watched master.

``DETOUR_REDIS_URL`` takes one of::

    redis://[[user]:password@]host[:port][/db]       one server (redis-py's own URL forms,
    rediss://[[user]:password@]host[:port][/db]      passed to it unchanged, query options
    unix://[[user]:password@]/path/to.sock[?db=N]    included)

    redis+cluster://[[user]:password@]host[:port][,host[:port]...][/]
    rediss+cluster://...                             TLS to every node

    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]
    rediss+sentinel://...                            TLS to the sentinels and the master

The listed hosts of a cluster URL are startup nodes (any reachable one will do; the
client reads the slot map from it); port 6379 when left out. The hosts of a sentinel
URL are sentinels (port 26379 when left out), ``service`` is the name in their
``sentinel monitor`` line, ``db`` the master's database (0 when left out). The
credentials are the data nodes' (the cluster's nodes, the Sentinel-managed master
and its replicas); sentinels that require their own take
``?sentinel_username=...&sentinel_password=...``. Hosts may be IPv6 in brackets,
and user, password and service are percent-decoded.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar
from urllib.parse import parse_qs, quote, unquote

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection, SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError

Mode = Literal["single", "cluster", "sentinel"]

_SCHEMES: dict[str, tuple[Mode, bool]] = {
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
}
_DEFAULT_PORT: dict[Mode, int] = {"single": 6379, "cluster": 6379, "sentinel": 26379}
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True)
class RedisTarget:
    """Where the store's Redis is, as read from its URL."""

    mode: Mode
    url: str = field(repr=False)
    #: Cluster startup nodes or sentinels.
    hosts: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ssl: bool = False
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)

    def node_auth(self) -> dict[str, Any]:
        """Credentials for a connection to one of the data nodes."""
        return {"username": self.username, "password": self.password}


def host_port(text: str, default_port: int, shown: str) -> tuple[str, int]:
    if text.startswith("["):  # [v6]:port
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad host {text!r} in redis URL {shown}")
        port_text = rest[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"empty host in redis URL {shown}")
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        raise ValueError(f"bad port {port_text!r} in redis URL {shown}") from None
    if not 0 < port < 65536:
        raise ValueError(f"bad port {port} in redis URL {shown}")
    return host, port


def parse_redis_url(url: str) -> RedisTarget:
    """Read a URL of any form above; ``ValueError`` says what is wrong with it."""
    shown = repr(describe_redis_url(url))  # errors are logged: never the password
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"redis URL {shown} has no scheme")
    if scheme.lower() not in _SCHEMES:
        # redis://, rediss://, unix://: redis-py reads these (and rejects the rest).
        return RedisTarget("single", url)
    mode, ssl = _SCHEMES[scheme.lower()]
    rest, _, query_text = rest.partition("?")
    netloc, _, path = rest.partition("/")
    try:
        query = parse_qs(query_text, keep_blank_values=True, strict_parsing=bool(query_text))
    except ValueError:
        raise ValueError(f"bad options in redis URL {shown}") from None
    unknown = sorted(set(query) - set(_SENTINEL_OPTIONS if mode == "sentinel" else ()))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} in redis URL")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user_text, colon, password_text = userinfo.partition(":")
        username = unquote(user_text) or None
        password = unquote(password_text) if colon else None
    hosts = tuple(
        host_port(h.strip(), _DEFAULT_PORT[mode], shown) for h in hostlist.split(",") if h.strip()
    )
    if not hosts:
        raise ValueError(f"redis URL {shown} names no host")
    parts = [unquote(p) for p in path.split("/")] if path else []
    while parts and parts[-1] == "":
        parts.pop()  # a trailing slash
    service, db = "", 0
    if mode == "cluster":
        if parts not in ([], ["0"]):
            raise ValueError(f"a cluster URL has no service or database (only db 0): {shown}")
    else:
        if not 1 <= len(parts) <= 2 or not parts[0]:
            raise ValueError(f"a sentinel URL names the service: .../service[/db], got {shown}")
        service = parts[0]
        if len(parts) == 2:
            if not parts[1].isdigit():
                raise ValueError(f"bad database {parts[1]!r} in redis URL {shown}")
            db = int(parts[1])

    def option(name: str) -> str | None:
        values = query.get(name)
        return values[-1] if values else None

    return RedisTarget(
        mode,
        url,
        hosts,
        service,
        db,
        username,
        password,
        ssl,
        option("sentinel_username"),
        option("sentinel_password"),
    )


def _no_retry() -> Retry:
    """Give up at once: the store has its own retry loop and journal."""
    return Retry(NoBackoff(), 0)


def _ssl_connection(ssl: bool) -> dict[str, Any]:
    """A bare ConnectionPool takes TLS as a connection class, not a flag."""
    return {"connection_class": SSLConnection} if ssl else {}


class _Client(Redis):
    """A client to one server (or the Sentinel master), counted for ``close_idle``
    (``_idle_keep``)."""

    used = False
    peak = 0
    busy = 0

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        _started(self)
        try:
            return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
        finally:
            self.busy -= 1


class _ClusterClient(RedisCluster):
    """A Cluster client, counted for ``close_idle`` (``_idle_keep``)."""

    used = False
    peak = 0
    busy = 0

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        _started(self)
        try:
            return await super().execute_command(*args, **kwargs)
        finally:
            self.busy -= 1


def _started(client: _Client | _ClusterClient) -> None:
    """A call: the client was used, and has one more under way (its peak since the last
    idle close is how many connections it needed at once)."""
    client.used = True
    client.busy += 1
    if client.busy > client.peak:
        client.peak = client.busy


def _idle_keep(client: _Client | _ClusterClient) -> int:
    """How many idle connections ``close_idle`` keeps open for the client, and counting
    starts again: as many as it had calls under way at once since the last close, at least
    one when used, none when unused. Closing those under steady load only made the next
    calls connect again, each within the reports' short timeout."""
    keep = max(1, client.peak) if client.used else 0
    client.used, client.peak = False, client.busy
    return keep


class _SentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """The master's pool under Sentinel, bounded like the others: past ``max_connections``
    a call waits (up to ``timeout``) for a connection instead of opening another."""


#: a pool's connection (a Cluster node's are ``Connection``s)
_C = TypeVar("_C", bound=AbstractConnection)


async def _close_free(free: list[_C] | deque[_C], keep: int, owned: list[_C] | None = None) -> int:
    """Disconnect the idle connections in ``free`` (a pool's own list of free connections)
    but the last ``keep`` connected ones (the most recently released); how many were closed.

    The ones to close leave ``free`` before the first await: a call that needs a connection
    while they close gets another one, never one being closed (when it did, reports under
    load failed with "Connection closed" every ``idle_close_s``). A pool's list takes them
    back, disconnected, at the end it hands out last (it connects them again when it hands
    them out). A Cluster node's (``owned``: all its connections) does not reconnect a closed
    connection, so they leave the node for good and it opens new ones when needed."""
    connected = [c for c in free if c.is_connected]
    closing = connected[: max(0, len(connected) - keep)]
    for c in closing:
        free.remove(c)
        if owned is not None:
            owned.remove(c)
    try:
        for c in closing:
            await c.disconnect()
    finally:
        if owned is None and isinstance(free, list):  # a pool's list: handed out from the end
            free[:0] = closing
    return len(closing)


class StoreClients:
    """The store's two clients on any deployment, and what to close with them.

    ``main`` (timeout ``timeout_s``) serves sync, snapshots and admin writes;
    ``fast`` (timeout ``fast_timeout_s``) serves reports. A cluster's ``fast``
    client does not retry a failed command on a fresh slot map (it still follows
    MOVED/ASK): a report has one short timeout before the journal takes it.
    Under Sentinel both follow the master through one shared ``Sentinel``,
    whose own connections use ``timeout_s``.

    Each client holds at most ``max_connections`` connections (per node in a Cluster);
    past that, a call waits for one (a Cluster's fails at once: the store then journals
    the report or answers unavailable). ``close_idle`` closes what sits unused.
    """

    def __init__(
        self,
        target: RedisTarget,
        timeout_s: float,
        fast_timeout_s: float,
        max_connections: int = 16,
        idle_close_s: float = 10.0,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        #: how often idle connections are closed (seconds): a client that sent nothing
        #: since the last time keeps none, one that did keeps one per server. A sidecar at
        #: rest thus holds its subscription and the connection its polls use; the one a
        #: report that moved a window opened closes within two of these once windows stop.
        self.idle_close_s = idle_close_s
        self._closers: list[Callable[[], Awaitable[Any]]] = []
        self.sentinel: Sentinel | None = None
        if target.mode == "sentinel":
            self.sentinel = Sentinel(  # type: ignore[no-untyped-call]
                list(target.hosts),
                sentinel_kwargs={
                    **_timeouts(timeout_s),
                    "username": target.sentinel_username,
                    "password": target.sentinel_password,
                    "ssl": target.ssl,
                    "retry": _no_retry(),  # a dead sentinel is skipped, the next one asked
                },
            )
            # Each poll asks the first sentinel where the master is: a fleet's processes
            # each start with another, so that no one sentinel answers them all.
            random.shuffle(self.sentinel.sentinels)
        self.main = self._open(timeout_s, retry=True)
        self.fast = self._open(fast_timeout_s, retry=False)
        if self.sentinel is not None:
            self._closers += [s.aclose for s in self.sentinel.sentinels]
        self._last_close = time.monotonic()

    def _open(self, timeout_s: float, *, retry: bool) -> Redis | RedisCluster:
        target = self.target
        common: dict[str, Any] = {"decode_responses": True, **_timeouts(timeout_s)}
        client: Redis | RedisCluster
        if target.mode == "single":
            # What the store always did for redis://, rediss://, unix://, bounded.
            pool = BlockingConnectionPool.from_url(
                target.url, max_connections=self.max_connections, timeout=timeout_s, **common
            )
            client = _Client.from_pool(pool)
        elif target.mode == "cluster":
            client = _ClusterClient(
                startup_nodes=[ClusterNode(host, port) for host, port in target.hosts],
                retry=None if retry else _no_retry(),
                ssl=target.ssl,
                max_connections=self.max_connections,
                **target.node_auth(),
                **common,
            )
        else:
            assert self.sentinel is not None
            client = self.sentinel.master_for(
                target.service,
                redis_class=_Client,
                connection_pool_class=_SentinelPool,
                db=target.db,
                ssl=target.ssl,
                max_connections=self.max_connections,
                timeout=timeout_s,
                **target.node_auth(),
                **common,
            )
        self._closers.append(client.aclose)
        return client

    def sentinel_pools(self) -> list[SentinelConnectionPool]:
        """Under Sentinel, the pools of both clients (each tracks the master it last found)."""
        pools = []
        for client in (self.main, self.fast):
            pool = client.connection_pool if isinstance(client, Redis) else None
            if isinstance(pool, SentinelConnectionPool):
                pools.append(pool)
        return pools

    def node_client(self, host: str, port: int, *, readonly: bool = False) -> Redis:
        """A plain client to one server (a Cluster node, a replica), configured like ``main``
        and bounded like it; the caller closes it (``aclose``) when done with it.
        ``readonly``: a Cluster replica, which answers reads of its shard only after
        ``READONLY`` (sent on each connection)."""
        extra: dict[str, Any] = {"redis_connect_func": _readonly} if readonly else {}
        pool = BlockingConnectionPool(
            host=host,
            port=port,
            db=self.target.db,
            decode_responses=True,
            max_connections=self.max_connections,
            timeout=self.timeout_s,
            **extra,
            **_timeouts(self.timeout_s),
            **self.target.node_auth(),
            **_ssl_connection(self.target.ssl),
        )
        return _Client.from_pool(pool)

    def replica_client(self, host: str, port: int) -> Redis:
        """A client to a replica of the primary (the fan-out tier) with the primary's
        credentials, database and TLS: ``node_client`` under Sentinel, the URL's own
        options with the replica's address for a single server."""
        if self.target.mode != "single":
            return self.node_client(host, port)
        options: dict[str, Any] = {**parse_url(self.target.url), "host": host, "port": port}
        options.pop("path", None)  # a unix:// primary: the replica is reached over TCP
        pool = BlockingConnectionPool(
            decode_responses=True,
            max_connections=self.max_connections,
            timeout=self.timeout_s,
            **_timeouts(self.timeout_s),
            **options,
        )
        return _Client.from_pool(pool)

    def held(self, *others: Redis | None) -> dict[str, int]:
        """Connections open now, by client: ``commands`` (sync, snapshots, admin writes),
        ``reports``, ``replica`` (``others``: the fan-out tier's replica client) and, under
        Sentinel, ``sentinel`` (the polls asking where the master is). (The subscription is
        counted by its owner.)"""
        out = {"commands": _connected(self.main), "reports": _connected(self.fast)}
        out["replica"] = sum(_connected(c) for c in others if c is not None)
        if self.sentinel is not None:
            out["sentinel"] = sum(_connected(c) for c in self.sentinel.sentinels)
        return out

    async def close_idle(self, routing_key: str, *others: Redis) -> int:
        """Every ``idle_close_s`` at most: close the idle connections of ``main``, ``fast``
        and ``others`` (the follower's read client) that no call needs. A client used since
        the last time keeps as many idle connections as it had calls under way at once, at
        least one (under Cluster, to the node serving ``routing_key``, the only node the
        store sends to); one unused keeps none. Returns how many were closed (0 when it
        was not time yet)."""
        now = time.monotonic()
        if now - self._last_close < self.idle_close_s:
            return 0
        self._last_close = now
        closed = 0
        for client in (self.main, self.fast, *others):
            keep = _idle_keep(client) if isinstance(client, _Client | _ClusterClient) else 1
            if isinstance(client, _ClusterClient):
                home = _owner(client, routing_key)
                # (the startup nodes keep the connections that read the slot map)
                nodes = {id(n): n for n in client.nodes_manager.startup_nodes.values()}
                nodes.update({id(n): n for n in client.get_nodes()})
                for node in nodes.values():
                    closed += await _close_free(
                        node._free, keep if node is home else 0, node._connections
                    )
            elif isinstance(client, Redis):
                pool = client.connection_pool
                if isinstance(pool, ConnectionPool):
                    closed += await _close_free(pool._available_connections, keep)
        return closed

    async def aclose(self) -> None:
        for close in self._closers:
            await close()


def _connected(client: Redis | RedisCluster) -> int:
    """How many of the client's connections are open (in use or idle), on every node."""
    if isinstance(client, RedisCluster):
        return sum(
            sum(1 for c in node._connections if c.is_connected) for node in client.get_nodes()
        )
    pool = client.connection_pool
    if isinstance(pool, ConnectionPool):
        return sum(
            1 for c in (*pool._available_connections, *pool._in_use_connections) if c.is_connected
        )
    return 0


async def _readonly(connection: AbstractConnection) -> None:
    """A new connection to a Cluster replica: the usual handshake, then ``READONLY``."""
    await connection.on_connect()
    await connection.send_command("READONLY")
    if str(await connection.read_response()) != "OK":
        raise ConnectionError("READONLY refused")


def _owner(cluster: RedisCluster, key: str) -> ClusterNode | None:
    """The node serving ``key``'s slot, as the client's slot map says (None: not known)."""
    try:
        return cluster.get_node_from_key(key)
    except (RedisClusterException, RedisError, KeyError):
        return None


def _timeouts(timeout_s: float) -> dict[str, Any]:
    return {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}


async def credentials_refused(url: str, timeout_s: float) -> str | None:
    """Why Redis refuses the URL's credentials (none, or wrong), or None.

    None also when Redis cannot be asked (down, unreachable): riding that out is the
    store's job. A refusal is a configuration error, which no retry mends.
    """
    try:
        clients = StoreClients(parse_redis_url(url), timeout_s, timeout_s)
    except (RedisError, ValueError):
        return None
    try:
        await clients.main.ping()
    except AuthenticationError as exc:
        return str(exc)
    except RedisError:
        return None
    finally:
        await clients.aclose()
    return None


def _userinfo(url: str) -> tuple[str, str, str | None, str]:
    """``(scheme, user, password or None, the rest after the credentials)`` of any form."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"redis URL {describe_redis_url(url)!r} has no scheme")
    cuts = [i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0]
    cut = min(cuts, default=len(rest))
    userinfo, at, hosts = rest[:cut].rpartition("@")
    user, colon, password = userinfo.partition(":")
    return scheme, user, password if at and colon and password else None, hosts + rest[cut:]


def has_password(url: str) -> bool:
    """Whether the URL carries a password itself."""
    return _userinfo(url)[2] is not None


def with_password(url: str, password: str) -> str:
    """``url`` (any form above) with ``password`` in its credentials, its user kept.

    Raises ``ValueError`` when the URL has a password already: two sources for one
    secret would leave which one counts to chance.
    """
    scheme, user, old, rest = _userinfo(url)
    if old is not None:
        raise ValueError(
            "DETOUR_REDIS_URL carries a password and DETOUR_REDIS_PASSWORD_FILE is set: "
            "give the password in one place"
        )
    return f"{scheme}://{user}:{quote(password, safe='')}@{rest}"


def read_password_file(path: str) -> str:
    """The password in ``path``, one trailing newline dropped (``echo`` adds one).

    Raises ``ValueError`` naming the file when it cannot be read or is empty.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"DETOUR_REDIS_PASSWORD_FILE {path}: {exc.strerror}") from None
    password = text.removesuffix("\n").removesuffix("\r")
    if not password:
        raise ValueError(f"DETOUR_REDIS_PASSWORD_FILE {path} is empty")
    return password


def describe_redis_url(url: str) -> str:
    """The URL for a log line: scheme, hosts and path, never credentials or options."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "(unparsable redis URL)"
    rest = rest.partition("?")[0].partition("#")[0]
    netloc, slash, path = rest.partition("/")
    return f"{scheme}://{netloc.rpartition('@')[2]}{slash}{path}"
