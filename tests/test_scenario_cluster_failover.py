"""Scenario: a Redis Cluster fails the namespace's shard over to a replica that missed the
last writes. Detour notices another server under its reconnection (another run_id) and
merges what it holds back into the new master (docs/reliability.md).

A real cluster on loopback: three masters, each with one replica. The fault is caused on
purpose: the owning shard's replica is frozen (``DEBUG SLEEP``) while Detour writes a route,
a config and windows that the master acknowledges; the master is SIGKILLed before the
replica wakes, so the stream it held for the replica is gone; the replica takes over
(``CLUSTER FAILOVER TAKEOVER``) without those writes.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator

import httpx
import pytest
import redis

from service.store import codec
from tests import raw_table
from tests.procs import RedisServer, ServiceProcess, free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

PREFIX = "detour:{default}"
META = f"{PREFIX}:meta"


class ReplicatedCluster:
    """Three masters and three replicas joined by ``redis-cli --cluster create``."""

    def __init__(self) -> None:
        self.nodes: list[RedisServer] = []
        bus: dict[int, int] = {}
        try:
            for _ in range(6):
                bus_port = free_port()
                self.nodes.append(RedisServer(extra=[
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-port", str(bus_port), "--cluster-node-timeout", "2000",
                    "--repl-diskless-sync-delay", "0", "--enable-debug-command", "local",
                    "--cluster-allow-reads-when-down", "yes"]))
                bus[self.nodes[-1].port] = bus_port
            cli = shutil.which("redis-cli")
            assert cli is not None, "redis-cli not found (Debian package redis-tools)"
            masters, replicas = self.nodes[:3], self.nodes[3:]
            subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in masters),
                 "--cluster-replicas", "0", "--cluster-yes"],
                check=True, capture_output=True, timeout=60)
            for master, replica in zip(masters, replicas, strict=True):
                with master.client() as m:
                    master_id = m.execute_command("CLUSTER", "MYID")
                with replica.client() as r:
                    r.execute_command("CLUSTER", "MEET", "127.0.0.1", master.port,
                                      bus[master.port])
                    wait_until(lambda r=r, i=master_id: i in r.execute_command(
                        "CLUSTER", "NODES"), 30, "the replica met its master")
                    r.execute_command("CLUSTER", "REPLICATE", master_id)
            wait_until(self._ready, 60, "cluster_state:ok with linked replicas", interval_s=0.1)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        for node in self.nodes:
            with node.client() as c:
                info = c.execute_command("CLUSTER", "INFO")
                if "cluster_state:ok" not in info or "cluster_known_nodes:6" not in info:
                    return False
                repl = c.info("replication")
                if repl["role"] == "slave" and repl.get("master_link_status") != "up":
                    return False
                # every node's slot map names each shard's replica (gossip has settled)
                if any(len(entry) < 4 for entry in c.execute_command("CLUSTER", "SLOTS")):
                    return False
        return True

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}/"

    def owner(self, key: str) -> tuple[RedisServer, RedisServer]:
        """The master serving ``key``'s slot and its replica."""
        with self.nodes[0].client() as c:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, (_, port, *_), *replicas in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    master = next(n for n in self.nodes if n.port == int(port))
                    rport = int(replicas[0][1])
                    return master, next(n for n in self.nodes if n.port == rport)
        raise AssertionError(f"slot of {key} not served")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture
def cluster() -> Iterator[ReplicatedCluster]:
    c = ReplicatedCluster()
    yield c
    c.stop()


def _replica_holds(replica: RedisServer, broker: str) -> bool:
    with replica.client() as c:
        c.execute_command("READONLY")
        return c.hget(f"{PREFIX}:faults", broker) is not None


def _asleep(replica: RedisServer) -> bool:
    """The replica does not answer a PING within 0.2 s (DEBUG SLEEP holds its one thread).
    A raw socket: a client library would retry the timeout until the answer came."""
    with socket.create_connection(("127.0.0.1", replica.port), timeout=1) as s:
        s.sendall(b"PING\r\n")
        s.settimeout(0.2)
        try:
            return not s.recv(16)
        except TimeoutError:
            return True


def test_a_cluster_failover_to_a_replica_that_missed_writes_loses_nothing(
        cluster: ReplicatedCluster) -> None:
    master, replica = cluster.owner(META)
    with ServiceProcess(redis_url=cluster.url, env={"DETOUR_SYNC_INTERVAL_S": "0.2",
                                                    "DETOUR_REDIS_CALL_TIMEOUT_S": "5"}) as svc, \
            httpx.Client(base_url=svc.url, timeout=15) as c:
        route = {"brokers": [{"brokerName": b, "writeQueueNums": 2} for b in "abc"]}
        assert c.put("/routes/t", json=route).status_code == 200
        assert c.put("/routes/gone", json=route).status_code == 200
        assert c.patch("/config", json={"maxAvoidedPercent": 90}).status_code == 200
        seen = c.post("/report-latency", json={"brokerName": "a", "latencyMs": 0,
                                               "isolation": True}).json()
        wait_until(lambda: _replica_holds(replica, "a"), 20, "a replicated")
        # Freeze the replica; the master keeps acknowledging, holding the stream for it.
        slept: list[BaseException | str] = []

        def freeze() -> None:
            try:
                with redis.Redis(host="127.0.0.1", port=replica.port, socket_timeout=30) as r:
                    slept.append(str(r.execute_command("DEBUG", "SLEEP", "6")))
            except BaseException as exc:  # noqa: BLE001 - the test reports it below
                slept.append(exc)

        sleeper = threading.Thread(target=freeze, daemon=True)
        sleeper.start()
        # 48 MB down the replication stream first: the sockets' buffers between the two fill
        # up, and what follows stays in the master's memory, lost when it is killed
        wait_until(lambda: _asleep(replica) or bool(slept), 10, "the replica asleep")
        assert not slept, slept
        with master.client() as m:
            for i in range(6):
                m.set(f"{PREFIX}:ballast{i}", b"x" * (8 << 20))
        assert c.put("/routes/u", json=route).status_code == 200
        assert c.patch("/config", json={"maxAvoidedPercent": 80}).status_code == 200
        assert c.delete("/routes/gone").status_code == 204
        missed = [c.post("/report-latency", json={"brokerName": f"m{i}", "latencyMs": 0,
                                                  "isolation": True}).json()
                  for i in range(5)]
        assert all(m["degraded"] is False for m in missed)  # the master acknowledged
        master.kill()  # the stream it held for the replica is gone with it
        sleeper.join(30)
        with replica.client() as r:
            assert r.execute_command("READONLY")
            assert r.hget(f"{PREFIX}:faults", "m0") is None  # the replica lacks them
            r.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
            wait_until(lambda: r.info("replication")["role"] == "master", 30,
                       "the replica took over")
            wait_until(lambda: r.hget(f"{PREFIX}:faults", "m4") is not None, 60,
                       "detour merged into the new master", interval_s=0.05)
            wait_until(lambda: httpx.get(svc.url + "/readyz", timeout=5).json()["degraded"]
                       is False, 30, "recovered", interval_s=0.05)
            stored = raw_table.fields(r, f"{PREFIX}:faults")
            faults = {b: codec.decode_fault(b, v) for b, v in stored.items()}
            for m in missed:
                assert faults[m["brokerName"]].available_at == m["availableAt"]
            assert faults["a"].available_at == seen["availableAt"]
            routes = raw_table.names(r, f"{PREFIX}:routes")
            assert {"t", "u"} <= routes and "gone" not in routes  # the delete was kept too
            assert '"maxAvoidedPercent":80' in r.hget(META, "config")  # the newer config
        assert c.get("/config").json()["maxAvoidedPercent"] == 80
        metrics = c.get("/metrics").text
        assert any(line.startswith("detour_store_reseeds_total{") and not line.endswith(" 0.0")
                   for line in metrics.splitlines())
