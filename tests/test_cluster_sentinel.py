"""Redis Cluster and Redis Sentinel for real: the behaviour suite on each, and a failover.

A 3-master cluster (``redis-cli --cluster create``) and a master + replica watched
by three sentinels run on loopback for the whole module. The behaviour suite
(``tests/test_behaviour.py``) runs on both: its test functions are imported here
and collected again, and this module overrides the ``settings`` fixture that the
shared ``client`` fixture (``tests/conftest.py``) builds the app from, with a
``deployment`` parameter choosing the URL. Nothing in the suite changes.

URLs that go through the app name one host (the app's startup log line parses the
URL with ``urlsplit``, which rejects a host list); host lists are tested on the
store directly.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from service.app import create_app
from service.settings import Settings
from service.store import ReportIn
from service.store.connect import describe_redis_url, parse_redis_url
from service.store.redis import RedisStore
from tests.asgi_client import TestClient
from tests.procs import (
    PATIENT_CALL_TIMEOUT_S,
    RedisServer,
    ServiceProcess,
    end_process,
    free_port,
    start_sentinel,
    wait_until,
    wait_until_async,
)
from tests.test_behaviour import *  # noqa: F403 - the behaviour suite, collected again below
from tests.test_behaviour import put_route, report, select
from tests.test_idle_close import close_while_calling
from tests.test_scenario_outage import Load

pytestmark = pytest.mark.integration

CHANNEL = "detour:{default}:changes"
META = "detour:{default}:meta"


# -- deployments ------------------------------------------------------------------


def _replication(server: RedisServer) -> dict[str, Any]:
    with server.client() as c:
        return dict(c.info("replication"))


class Cluster:
    """Three ``redis-server --cluster-enabled yes`` masters joined by ``redis-cli --cluster``."""

    def __init__(self, masters: int = 3) -> None:
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(masters):
                self.nodes.append(RedisServer(extra=[
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    # The bus port defaults to port + 10000, past 65535 for a high port.
                    # No test here fails a node over: a node timeout no busy machine reaches.
                    "--cluster-port", str(free_port()), "--cluster-node-timeout", "30000"]))
            cli = shutil.which("redis-cli")
            assert cli is not None, "redis-cli not found (Debian package redis-tools)"
            subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes"],
                check=True, capture_output=True, timeout=60)

            def ready() -> bool:
                for node in self.nodes:
                    with node.client() as c:
                        info = c.execute_command("CLUSTER", "INFO")
                        if "cluster_state:ok" not in info or \
                                f"cluster_known_nodes:{masters}" not in info:
                            return False
                return True

            wait_until(ready, 30, "cluster_state:ok on every node", interval_s=0.1)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        # One startup node is enough: the client reads the others from it.
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}/"

    @property
    def url_all_nodes(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes) + "/"

    def owner(self, key: str) -> RedisServer:
        """The node serving ``key``'s slot."""
        with self.nodes[0].client() as c:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, (_, port, *_), *_ in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == int(port))
        raise AssertionError(f"slot of {key} not served")

    def subscribers(self) -> dict[int, int]:
        """Per node port: connections subscribed to the changes channel on that node, a
        sharded channel (``SSUBSCRIBE``); none may be on the classic channel of that name."""
        out = {}
        for node in self.nodes:
            with node.client() as c:
                assert int(dict(c.pubsub_numsub(CHANNEL))[CHANNEL]) == 0, "a classic subscription"
                _, count = c.execute_command("PUBSUB", "SHARDNUMSUB", CHANNEL)
                out[node.port] = int(count)
        return out

    def flush(self) -> None:
        for node in self.nodes:
            with node.client() as c:
                c.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class SentinelSetup:
    """A master, a replica (``--replicaof``) and ``count`` sentinels watching them as ``detour``.

    Both data servers fsync every write to their AOF before answering. The
    sentinels declare the master down after ``down_after_ms``; any one of them may
    (quorum 1), and the failover needs a majority of them to elect a leader. The
    default is one no busy machine reaches, so the sentinels never fail over on their
    own; a test that kills the master asks for 500 ms.
    """

    def __init__(self, count: int = 3, down_after_ms: int = 30_000) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="detour-sentinel-"))
        # A name of its own: a sentinel counts and follows only sentinels that announce the
        # same name, so another deployment of the suite's (another worker's) is never mixed in.
        self.name = f"detour-{secrets.token_hex(4)}"
        self.sentinels: list[subprocess.Popen[bytes]] = []
        self.sentinel_ports: list[int] = []
        # No 5 s wait for more replicas before the first full sync.
        self.master = RedisServer(persistent=True, extra=["--repl-diskless-sync-delay", "0"])
        self.replica: RedisServer | None = None
        try:
            self.replica = RedisServer(
                persistent=True, extra=["--replicaof", "127.0.0.1", str(self.master.port),
                                        "--repl-diskless-sync-delay", "0"])
            replica = self.replica
            wait_until(lambda: _replication(replica)["master_link_status"] == "up", 20,
                       "replica in sync")
            self.sentinel_ports = []
            for _ in range(count):
                proc, port = start_sentinel(
                    self.dir,
                    f"sentinel monitor {self.name} 127.0.0.1 {self.master.port} 1\n"
                    f"sentinel down-after-milliseconds {self.name} {down_after_ms}\n"
                    f"sentinel failover-timeout {self.name} 5000\n"
                    f"sentinel parallel-syncs {self.name} 1\n")
                self.sentinels.append(proc)
                self.sentinel_ports.append(port)

            seen: dict[int, object] = {}  # what each sentinel last said, for a timeout

            def ready(port: int) -> bool:
                with self.sentinel_client(port) as s:
                    state = s.sentinel_master(self.name)
                    replicas = s.sentinel_slaves(self.name)
                seen[port] = (state["num-other-sentinels"], state["port"], [
                    {k: r[k] for k in ("port", "is_disconnected", "is_sdown", "runid",
                                       "master-link-status")} for r in replicas])
                if state["num-other-sentinels"] != count - 1 or len(replicas) != 1:
                    return False
                # Linked and read (INFO): else the sentinel would find no replica to promote.
                r = replicas[0]
                return not (r["is_disconnected"] or r["is_sdown"] or not r["runid"]
                            or r["master-link-status"] != "ok")

            def watching() -> bool:
                # (each one asked every time: a timeout then says what every sentinel saw)
                return all([ready(port) for port in self.sentinel_ports])

            # Sentinels find each other through the master's hello channel (every 2 s).
            try:
                wait_until(watching, 30, "sentinels ready to fail over", interval_s=0.1)
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; master {self.master.port}, replica "
                                   f"{replica.port}; each sentinel's (other sentinels, "
                                   f"master port, replicas): {seen}") from None
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def sentinel_client(port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, decode_responses=True)

    def url(self, sentinels: list[int] | None = None) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in (sentinels or self.sentinel_ports))
        return f"redis+sentinel://{hosts}/{self.name}/0"

    def master_port(self) -> int:
        """Where the sentinels say the master is."""
        with self.sentinel_client(self.sentinel_ports[0]) as s:
            _, port = s.sentinel_get_master_addr_by_name(self.name)
            return int(port)

    def flush(self) -> None:
        with self.master.client() as c:
            c.flushall()
            c.wait(1, 2000)  # the replica too, so no test sees another's data

    def stop(self) -> None:
        for proc in self.sentinels:
            end_process(proc)
        if self.replica is not None:
            self.replica.stop()
        self.master.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def sentinel() -> Iterator[SentinelSetup]:
    s = SentinelSetup()
    try:
        yield s
    finally:
        s.stop()


# -- the behaviour suite on both deployments -----------------------------------------


@pytest.fixture(params=["cluster", "sentinel"])
def deployment(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_kind() -> str:
    """What /healthz names: one Redis store, whatever the deployment."""
    return "redis"


@pytest.fixture
def settings(deployment: str, request: pytest.FixtureRequest) -> Settings:
    """Overrides conftest's: the shared ``client`` fixture builds its app from this."""
    if deployment == "cluster":
        c: Cluster = request.getfixturevalue("cluster")
        c.flush()
        return Settings(redis_url=c.url, redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)
    s: SentinelSetup = request.getfixturevalue("sentinel")
    s.flush()
    # One host: see the module doc. No test here is about the report timeout: a report the
    # 50 ms default sent to the journal on a busy machine would be answered degraded.
    return Settings(redis_url=s.url(s.sentinel_ports[:1]),
                    redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)


# -- URLs ------------------------------------------------------------------------------


@pytest.mark.unit
def test_url_forms() -> None:
    t = parse_redis_url("redis+cluster://u:p%40ss@10.0.0.1:7000,[::1]:7001,node-3/")
    assert (t.mode, t.hosts, t.username, t.password, t.ssl) == (
        "cluster", (("10.0.0.1", 7000), ("::1", 7001), ("node-3", 6379)), "u", "p@ss", False)
    t = parse_redis_url("rediss+sentinel://:pw@s1,s2:26380/my%20master/3?sentinel_password=x")
    assert (t.mode, t.hosts, t.service, t.db, t.password, t.ssl, t.sentinel_password) == (
        "sentinel", (("s1", 26379), ("s2", 26380)), "my master", 3, "pw", True, "x")
    assert parse_redis_url("redis+sentinel://s1/detour").db == 0
    for plain in ("redis://:pw@h:6379/2", "rediss://h", "unix:///run/redis.sock?db=1"):
        assert parse_redis_url(plain).mode == "single"
    for bad in ("redis+sentinel://s1:26379/", "redis+sentinel://s1/detour/x",
                "redis+cluster://h:7000/2", "redis+cluster://h:port/", "redis+cluster:///",
                "redis+cluster://h/?foo=1", "redis+sentinel://a:secret@s1:0/detour"):
        with pytest.raises(ValueError) as err:
            parse_redis_url(bad)
        assert "secret" not in str(err.value)
    assert describe_redis_url("redis+sentinel://a:secret@s1,s2/detour/0?sentinel_password=x") \
        == "redis+sentinel://s1,s2/detour/0"
    assert "secret" not in repr(parse_redis_url("redis+cluster://a:secret@h/"))


# -- cluster ---------------------------------------------------------------------------


def _avoids(client: TestClient, broker: str) -> bool:
    return all(select(client, "t")["brokerName"] != broker for _ in range(4))


def test_cluster_keeps_a_namespace_on_one_node_and_replicas_follow_each_other(
    cluster: Cluster,
) -> None:
    cluster.flush()
    # No poll within the test: what reaches the other replica comes by push.
    settings = Settings(redis_url=cluster.url, sync_interval_s=60,
                        redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        put_route(a, "t", {"x": 1, "y": 1})
        wait_until(lambda: b.post("/select", json={"topic": "t"}).status_code == 200, 15,
                   "the route pushed to the other replica")
        report(a, "x", 0, isolation=True)
        wait_until(lambda: _avoids(b, "x"), 15, "the window pushed to the other replica")
        assert b.delete("/fault-items/x").status_code == 204
        wait_until(lambda: not _avoids(a, "x"), 15, "the restore pushed back")
        # Both subscribed on the node that serves the namespace's slot.
        owner = cluster.owner(META)
        assert cluster.subscribers() == {n.port: 2 if n is owner else 0 for n in cluster.nodes}
    holders = {}
    for node in cluster.nodes:
        with node.client() as c:
            if keys := sorted(c.keys("*")):
                holders[node.port] = keys
    # (the faults hash keeps the table's mark after its last entry; the delete left its
    # grave)
    assert holders == {owner.port: ["detour:{default}:events", "detour:{default}:faults",
                                    "detour:{default}:graves",
                                    "detour:{default}:graves-by-time",
                                    "detour:{default}:latency-log",
                                    "detour:{default}:meta", "detour:{default}:routes",
                                    "detour:{default}:writers",
                                    "detour:{default}:writers-seen"]}


def test_cluster_subscription_resumes_on_the_slots_node(cluster: Cluster) -> None:
    """The change channel is a sharded one: only the slot's shard carries it, so a lost
    subscription resumes on the node serving the slot, and pushes flow again."""
    cluster.flush()
    settings = Settings(redis_url=cluster.url_all_nodes, sync_interval_s=60,
                        redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)
    owner = cluster.owner(META)

    async def scenario() -> None:
        writer, follower = RedisStore(settings), RedisStore(settings)
        await writer.start()
        await follower.start()
        try:
            # The sync loops subscribe after start() returns.
            await wait_until_async(lambda: cluster.subscribers()[owner.port] == 2, 20,
                                   "both subscribed on the slot's node", interval_s=0.05)
            assert cluster.subscribers() == {n.port: 2 if n is owner else 0
                                             for n in cluster.nodes}
            with owner.client() as c:
                ids = [x["id"] for x in c.client_list() if x.get("ssub") == "1"]
                assert len(ids) == 2
                for i in ids:
                    c.client_kill_filter(_id=i)  # both lose their subscription

            def back() -> bool:
                # Synced: subscribed again and the snapshot taken after it. Until then the
                # writer's report would go to its journal (replayed at the next poll, a
                # minute away) and never be pushed.
                with owner.client() as c:
                    again = sum(1 for x in c.client_list() if x.get("ssub") == "1")
                return again == 2 and writer.synced.is_set() and follower.synced.is_set()

            await wait_until_async(back, 20, "both subscribed again on the slot's node",
                                   interval_s=0.05)
            assert cluster.subscribers() == {n.port: 2 if n is owner else 0
                                             for n in cluster.nodes}
            (outcome,) = await writer.report_many([ReportIn("x", 0, True)])
            assert not writer.degraded, "the report went to the journal, not to Redis"
            assert outcome.available_at > outcome.now_ms
            await wait_until_async(lambda: "x" in follower.view.faults, 20,
                                   "the push on the follower", interval_s=0.05)
        finally:
            await follower.close()
            await writer.close()

    asyncio.run(scenario())


# -- sentinel --------------------------------------------------------------------------


def test_sentinel_url_skips_a_dead_sentinel(sentinel: SentinelSetup) -> None:
    sentinel.flush()
    dead = free_port()  # nothing listens there
    settings = Settings(redis_url=sentinel.url([dead, *sentinel.sentinel_ports]),
                        redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)

    async def scenario() -> None:
        store = RedisStore(settings)
        await store.start()
        try:
            await asyncio.wait_for(store.synced.wait(), 20)
            outcome, = await store.report_many([ReportIn("x", 0, True)])
            assert outcome.available_at > outcome.now_ms
            assert not store.degraded
        finally:
            await store.close()

    asyncio.run(scenario())
    with sentinel.master.client() as c:
        assert c.hget("detour:{default}:faults", "x") is not None
        assert int(dict(c.pubsub_numsub(CHANNEL))[CHANNEL]) == 0  # closed cleanly


def test_sentinel_lists_the_replicas_a_process_reads(sentinel: SentinelSetup) -> None:
    """``DETOUR_REDIS_REPLICAS=sentinel``: subscribed to and polling the replica the
    sentinels list, writing on the master; another process's window arrives through it."""
    sentinel.flush()
    replica = sentinel.replica
    assert replica is not None
    url = sentinel.url(sentinel.sentinel_ports[:1])
    reader_settings = Settings(redis_url=url, redis_replicas="sentinel", sync_interval_s=60,
                               redis_primary_poll_s=60,
                               redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)
    writer_settings = Settings(redis_url=url, redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)

    def subscribed(server: RedisServer) -> int:
        with server.client() as c:
            return int(dict(c.pubsub_numsub(CHANNEL))[CHANNEL])

    async def scenario() -> None:
        reader, writer = RedisStore(reader_settings), RedisStore(writer_settings)
        await reader.start()
        await writer.start()
        try:
            await wait_until_async(
                lambda: (subscribed(sentinel.master), subscribed(replica)) == (1, 1)
                and reader.synced.is_set(), 20, "the reader on the replica, the writer on "
                "the master", interval_s=0.05)
            (out,) = await writer.report_many([ReportIn("x", 0, True)])
            await wait_until_async(lambda: "x" in reader.view.faults, 10, "the push")
            assert reader.view.faults["x"].available_at == out.available_at
            (mine,) = await reader.report_many([ReportIn("y", 0, True)])
            assert not reader.degraded and mine.available_at > mine.now_ms
            with sentinel.master.client() as c:
                assert c.hget("detour:{default}:faults", "y") is not None
        finally:
            await writer.close()
            await reader.close()

    asyncio.run(scenario())


@pytest.mark.e2e
@pytest.mark.slow
def test_sentinel_failover_under_load_loses_no_report(tmp_path: Path) -> None:
    """The master dies under load; the sentinels promote the replica; nothing is lost.

    Before the kill the master's writes are paused and the replica has caught up
    (what Redis's FAILOVER does): every report the master acknowledged is on the
    replica that takes over, every report it did not is in the replica's journal.
    """
    setup = SentinelSetup(down_after_ms=500)  # the master is killed on purpose below
    svc: ServiceProcess | None = None
    load: Load | None = None
    try:
        old_master, new_master = setup.master, setup.replica
        assert new_master is not None
        svc = ServiceProcess(redis_url=setup.url(setup.sentinel_ports[:1]),
                             env={"DETOUR_SYNC_INTERVAL_S": "0.2"},
                             log_path=tmp_path / "detour.log")
        load = Load(svc.url)
        with httpx.Client(base_url=svc.url, timeout=5) as c:
            c.put("/routes/t", json={"brokers": [{"brokerName": f"r{i}", "writeQueueNums": 2}
                                                 for i in range(3)]})
        load.thread.start()
        wait_until(lambda: len(load.accepted) >= 100, 20, "load before the failover")

        with old_master.client() as m:
            m.execute_command("CLIENT", "PAUSE", "30000", "WRITE")
        offset = _replication(old_master)["master_repl_offset"]
        wait_until(lambda: _replication(new_master)["master_repl_offset"] >= offset, 20,
                   "the replica caught up")
        old_master.kill_holding_port()  # its sentinels keep trying the port
        at_kill = len(load.accepted)
        wait_until(lambda: setup.master_port() == new_master.port, 30, "sentinels promoted")

        def converged() -> bool:
            return httpx.get(svc.url + "/readyz", timeout=5).json()["degraded"] is False

        wait_until(converged, 30, "journal replayed on the new master", interval_s=0.05)
        at_return = len(load.accepted)
        wait_until(lambda: len(load.accepted) >= at_return + 100, 20, "load after the failover")
        load.stop.set()
        load.thread.join(10)

        assert load.failures == []
        journaled = [a for a in load.accepted[at_kill:] if a[2]]
        assert journaled, "no report was taken while there was no master"
        with httpx.Client(base_url=svc.url, timeout=10) as c:
            table = {i["brokerName"]: i for i in c.get("/fault-items").json()["items"]}
        missing = [b for b, _, _ in load.accepted if b not in table]
        assert missing == [], f"{len(missing)} of {len(load.accepted)} accepted reports lost"
        assert all(not table[b]["available"] for b, _, _ in load.accepted)
        # Each replayed window ends where the replica said when it accepted the report.
        drift = [abs(table[b]["availableAt"] - end) for b, end, _ in journaled]
        assert max(drift) < 1000, max(drift)
        # The sync loop subscribed again on the new master.
        with new_master.client() as c:
            assert int(dict(c.pubsub_numsub(CHANNEL))[CHANNEL]) == 1
    finally:
        if load is not None:
            load.stop.set()
        if svc is not None:
            svc.stop()
        setup.stop()



def test_sentinel_switchover_moves_the_store_before_the_old_master_steps_down() -> None:
    """``SENTINEL FAILOVER``: the old master keeps accepting writes until the sentinels
    reconfigure it (about ten seconds); the store follows the sentinels within a poll."""
    setup = SentinelSetup(count=1)  # one sentinel: no wait for sentinels to meet
    settings = Settings(redis_url=setup.url(), sync_interval_s=0.2,
                        redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)
    old, new = setup.master, setup.replica
    assert new is not None

    def subscribed(server: RedisServer) -> int:
        with server.client() as c:
            return int(dict(c.pubsub_numsub(CHANNEL))[CHANNEL])

    async def scenario() -> None:
        store = RedisStore(settings)
        await store.start()
        try:
            await wait_until_async(lambda: subscribed(old) == 1, 20, "subscribed on the master",
                                   interval_s=0.05)
            with setup.sentinel_client(setup.sentinel_ports[0]) as s:
                s.execute_command("SENTINEL", "FAILOVER", setup.name)
            await wait_until_async(lambda: setup.master_port() == new.port, 30,
                                   "the sentinel names the new master", interval_s=0.05)
            # Within a poll (0.2 s), well before the old master steps down (about 10 s).
            await wait_until_async(lambda: subscribed(new) == 1 and store.synced.is_set(), 8,
                                   "the store on the new master", interval_s=0.05)
            assert (subscribed(old), subscribed(new)) == (0, 1)
            outcome, = await store.report_many([ReportIn("x", 0, True)])
            assert outcome.available_at > outcome.now_ms and not store.degraded
            with new.client() as c:
                assert c.hget("detour:{default}:faults", "x") is not None
            with old.client() as c:  # still a master: the store did not wait for that
                assert c.execute_command("ROLE")[0] == "master"
        finally:
            await store.close()

    try:
        asyncio.run(scenario())
    finally:
        setup.stop()


# -- closing idle connections (tests/test_idle_close.py), under Sentinel -----------------


def test_calls_during_an_idle_close_get_no_closing_connection_under_sentinel(
    sentinel: SentinelSetup,
) -> None:
    """The Sentinel master's pool: closing idle connections while calls run never cuts a
    call off."""
    closed, failures = close_while_calling(
        sentinel.url(sentinel.sentinel_ports[:1]), rounds=10, calls=6
    )
    assert failures == []
    assert closed > 0
