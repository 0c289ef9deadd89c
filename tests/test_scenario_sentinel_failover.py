"""A Sentinel failover to a replica that missed the last writes: nothing a Detour replica
holds is lost (docs/reliability.md, "Redis lost its data")."""

from __future__ import annotations

import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from service.store import codec
from tests import raw_table
from tests.procs import (
    PATIENT_ENV,
    RedisServer,
    ServiceProcess,
    end_process,
    start_sentinel,
    wait_until,
)
from tests.proxy import DelayProxy

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

PREFIX = "detour:{default}"


def _info(server: RedisServer) -> dict[str, Any]:
    with server.client() as c:
        return dict(c.info("replication"))


def test_failover_to_a_replica_that_missed_writes_loses_nothing_a_replica_holds() -> None:
    """The replica replicates through a proxy that stops passing the stream on: the
    master takes a route and windows the replica never gets, then dies, and the sentinel
    promotes the replica. Detour sees its own writes missing and re-seeds them."""
    workdir = Path(tempfile.mkdtemp(prefix="detour-failover-"))
    master = RedisServer(extra=["--repl-diskless-sync-delay", "0"])
    proxy = DelayProxy(master.port)
    replica = RedisServer(extra=["--replicaof", "127.0.0.1", str(proxy.port),
                                 "--repl-diskless-sync-delay", "0"])
    # A name of its own: no other deployment's sentinel of the suite counts or follows it.
    name = f"detour-{secrets.token_hex(4)}"
    # A long failover-timeout: the sentinel leaves the replica's master address (the
    # proxy) alone for the length of the test.
    sentinel, sentinel_port = start_sentinel(
        workdir, f"sentinel monitor {name} 127.0.0.1 {master.port} 1\n"
                 f"sentinel down-after-milliseconds {name} 500\n"
                 f"sentinel failover-timeout {name} 120000\n")
    svc: ServiceProcess | None = None
    try:
        wait_until(lambda: _info(replica)["master_link_status"] == "up", 20, "replica in sync")

        def watching() -> bool:
            with redis.Redis(port=sentinel_port, socket_timeout=2,
                             decode_responses=True) as s:
                replicas = s.sentinel_slaves(name)
            return len(replicas) == 1 and replicas[0]["master-link-status"] == "ok" \
                and not replicas[0]["is_disconnected"]

        wait_until(watching, 30, "the sentinel sees the replica", interval_s=0.1)
        url = f"redis+sentinel://127.0.0.1:{sentinel_port}/{name}/0"
        # (patient calls: the scenario needs the master to acknowledge the missed reports)
        svc = ServiceProcess(redis_url=url, env={"DETOUR_SYNC_INTERVAL_S": "0.2", **PATIENT_ENV})
        with httpx.Client(base_url=svc.url, timeout=10) as c:
            route = {"brokers": [{"brokerName": b, "writeQueueNums": 2} for b in "abc"]}
            assert c.put("/routes/t", json=route).status_code == 200
            seen = c.post("/report-latency", json={"brokerName": "a", "latencyMs": 0,
                                                   "isolation": True}).json()
            with replica.client() as r:
                wait_until(lambda: r.hget(f"{PREFIX}:faults", "a") is not None, 10,
                           "a replicated")
            # From here on the replica receives nothing more.
            proxy.hold_s = 3600
            c.put("/routes/u", json=route)
            missed = [c.post("/report-latency", json={"brokerName": f"m{i}", "latencyMs": 0,
                                                      "isolation": True}).json()
                      for i in range(5)]
            assert all(m["degraded"] is False for m in missed)  # the master acknowledged
            assert proxy.held > 0
            with replica.client() as r:
                assert r.hget(f"{PREFIX}:faults", "m0") is None  # the replica lacks them
            master.kill_holding_port()  # the sentinel keeps trying the port
            proxy.close()  # the held stream is gone with the link
            with redis.Redis(port=sentinel_port, socket_timeout=2,
                             decode_responses=True) as s:
                wait_until(lambda: int(s.sentinel_get_master_addr_by_name(name)[1])
                           == replica.port, 60, "the sentinel promoted the replica")
            with replica.client() as r:
                wait_until(lambda: r.hget(f"{PREFIX}:faults", "m4") is not None, 30,
                           "detour re-seeded the promoted replica", interval_s=0.05)
                wait_until(lambda: httpx.get(svc.url + "/readyz", timeout=5).json()[
                    "degraded"] is False, 30, "recovered", interval_s=0.05)
                faults = raw_table.fields(r, f"{PREFIX}:faults")
                for m in missed:
                    item = codec.decode_fault("", faults[m["brokerName"]])
                    assert item.available_at == m["availableAt"]
                assert codec.decode_fault("a", faults["a"]).available_at == seen["availableAt"]
                assert {"t", "u"} <= set(r.hkeys(f"{PREFIX}:routes"))
            items = {i["brokerName"] for i in c.get("/fault-items").json()["items"]}
            assert {"a", "m0", "m4"} <= items
            metrics = c.get("/metrics").text
            reseeds = sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
                          if ln.startswith("detour_store_reseeds_total{"))
            assert reseeds >= 1
    finally:
        if svc is not None:
            svc.stop()
        end_process(sentinel)
        proxy.close()
        replica.stop()
        master.stop()
        shutil.rmtree(workdir, ignore_errors=True)
