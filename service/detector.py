"""The active detector (RocketMQ 5's ``startDetectorEnable``): TCP-connect to avoided brokers
and record whether they answer, so pickOneAtLeast prefers the reachable ones.

One replica per namespace runs it at a time (a lease in the store, renewed each round),
so a thousand sidecars do not connect a thousand times to a broker that is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

from detour import policy
from detour.model import Config, FaultItem, Route
from service import metrics
from service.cancelling import honour_cancel
from service.errors import StoreUnavailable
from service.store import FaultStore

log = logging.getLogger("detour.detector")

#: The lease outlives a round by this factor, so a replica that stopped is replaced
#: within a few intervals and a slow round does not lose it.
LEASE_ROUNDS = 3


def targets(
    routes: Mapping[str, Route], faults: Mapping[str, FaultItem], now_ms: int, config: Config
) -> dict[str, str]:
    """Brokers to check: those with an address in some route whose window is open or
    that wait on probation; ``{broker: "host:port"}``. Pure."""
    out: dict[str, str] = {}
    for route in routes.values():
        for broker, address in route.addresses.items():
            item = faults.get(broker)
            if address is None or item is None:
                continue
            if now_ms < item.available_at or policy.on_probation(item, now_ms, config):
                out[broker] = address
    return out


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


async def reachable(address: str, timeout_s: float) -> bool:
    """Whether a TCP connection to ``address`` opens within ``timeout_s``."""
    host, port = split_address(address)
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def detect_once(store: FaultStore) -> dict[str, bool] | None:
    """One round: None when the detector is off or another replica holds the lease."""
    view = store.view
    config = view.config
    if not config.detector_enable or not config.send_latency_fault_enable:
        return None
    if not await store.detector_lease(config.detect_interval_ms * LEASE_ROUNDS):
        return None
    found = targets(view.routes, view.faults, view.now_ms(), config)
    if not found:
        return {}
    timeout_s = config.detect_timeout_ms / 1000
    results = await asyncio.gather(*(reachable(a, timeout_s) for a in found.values()))
    readings = dict(zip(found, results, strict=True))
    await store.set_reachability(readings)
    for ok in results:
        metrics.DETECTIONS.labels(store.namespace, "reachable" if ok else "unreachable").inc()
    return readings


async def run(store: FaultStore) -> None:
    """Detect every ``detectIntervalMs`` until cancelled; a store outage skips a round."""
    while True:
        try:
            await detect_once(store)
        except StoreUnavailable as exc:
            log.warning("detector round skipped: %s", exc.message)
        honour_cancel()  # a stop that landed inside a Redis call (service/cancelling.py)
        await asyncio.sleep(store.view.config.detect_interval_ms / 1000)
