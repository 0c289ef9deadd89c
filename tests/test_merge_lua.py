"""The one merge rule, twice: detour.merge (Python) and reseed.lua (inside Redis) agree.

A property test writes one copy of a broker's item into a real table, merges another into
it through the real script, as a replica's merge calls it (service/store/merge.py), and
compares what the table holds with ``merge_items`` of the two: ties of window ends with
different reasons and stamps included (the case that once made the merge order-dependent).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from detour.merge import merge_items
from detour.model import FaultItem, Why
from service.store import codec
from service.store.merge import Candidates, calls
from tests.budget import examples
from tests.lua import CHANNEL, PREFIX, script
from tests.procs import RedisServer
from tests.test_merge import NOW, items

pytestmark = pytest.mark.integration

enc = codec.encode_fault
KEYS = [f"{PREFIX}:{k}" for k in ("faults", "routes", "meta", "events", "ends", "graves",
                                  "graves-index")]
E = NOW + 30_000


@pytest.fixture(scope="module")
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    yield client
    client.close()


def merged_in_redis(raw: redis.Redis, theirs: FaultItem | None, mine: FaultItem) -> str | None:
    raw.delete(*KEYS)
    if theirs is not None:
        raw.hset(KEYS[0], "a", enc(theirs))
    reseed = script(raw, "reseed")
    head = [CHANNEL, "epoch-1", 0, "replica-test"]
    for args in calls(Candidates(items=[("a", enc(mine))]), head, cap=10, announce=False):
        reseed(keys=KEYS, args=args)
    value = raw.hget(KEYS[0], "a")
    return None if value is None else str(value)


@settings(max_examples=examples(), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(theirs=st.one_of(st.none(), items), mine=items)
@example(  # ends tie, reasons differ, the later-stamped copy has the lower reason
    theirs=FaultItem("a", 0, E, stamp=2, why=None),
    mine=FaultItem("a", 0, E, stamp=1, why=Why("isolation", NOW, 0, "")),
)
@example(  # ends and reasons tie but for the latency: compared as numbers, not text
    theirs=FaultItem("a", 0, E, stamp=3, why=Why("latency", NOW, 100, "p1")),
    mine=FaultItem("a", 0, E, stamp=1, why=Why("latency", NOW, 60, "p1")),
)
def test_reseed_lua_merges_as_merge_items(raw: redis.Redis, theirs: FaultItem | None,
                                          mine: FaultItem) -> None:
    want = merge_items(theirs, mine, enc)
    assert want is not None
    assert merged_in_redis(raw, theirs, mine) == enc(want)
