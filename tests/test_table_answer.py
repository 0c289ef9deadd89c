"""``GET /fault-items``' body (service/api/table_answer.py): the model's, and kept exactly
while nothing in it can differ."""

from __future__ import annotations

import json
import random

import pytest

from detour.model import FaultItem, Why
from service.api.table_answer import TableAnswers
from service.schemas import FaultItemOut, FaultItemsOut, WhyOut

pytestmark = pytest.mark.unit

NOW = 1_763_791_200_000


def modelled(now: int, items: list[FaultItem]) -> object:
    """The body as the response models render it (what the route returned before)."""
    return FaultItemsOut(
        now=now,
        items=[
            FaultItemOut(
                broker_name=i.broker_name,
                current_latency_ms=i.current_latency_ms,
                available_at=i.available_at,
                available=i.is_available(now),
                probation=i.probation,
                reachable=i.reachable,
                why=None if i.why is None or i.is_available(now) else WhyOut.model_validate(
                    {"reason": i.why.reason, "since": i.why.since,
                     "latencyMs": i.why.latency_ms, "by": i.why.by}),
            )
            for i in sorted(items, key=lambda i: i.broker_name)
        ],
    ).model_dump(mode="json", by_alias=True)  # fmt: skip


def random_items(rng: random.Random, n: int) -> list[FaultItem]:
    reasons = ["isolation", "latency", "quorum", "pending", "probe"]
    return [
        FaultItem(
            f"broker-{rng.randrange(10**6)}-{k}",
            rng.randrange(0, 20_000),
            NOW + rng.randrange(-60_000, 600_000),
            probation=rng.random() < 0.2,
            reachable=rng.choice([None, True, False]),
            why=None if rng.random() < 0.3 else Why(
                rng.choice(reasons), NOW - rng.randrange(10_000), rng.randrange(5000),
                rng.choice(["p1", "p2", "señor-ü"])),
        )
        for k in range(n)
    ]  # fmt: skip


@pytest.mark.parametrize("seed", range(8))
def test_the_body_is_the_models(seed: int) -> None:
    rng = random.Random(seed)
    items = random_items(rng, rng.randrange(0, 60))
    answers = TableAnswers()
    for now in (NOW, NOW + rng.randrange(1, 700_000)):
        assert json.loads(answers.body("store", now, items)) == modelled(now, items)


def test_a_kept_body_changes_when_a_window_ends_or_an_item_does() -> None:
    store = object()
    items = [FaultItem("a", 5, NOW + 1000, why=Why("latency", NOW - 5, 600, "p")),
             FaultItem("b", 5, NOW + 5000)]  # fmt: skip
    answers = TableAnswers()
    first = answers.body(store, NOW, items)
    # The same items, before the first window end: kept (only `now` differs).
    again = answers.body(store, NOW + 999, list(items))
    assert again.replace(b'"now":%d' % (NOW + 999), b'"now":%d' % NOW) == first
    # The window of "a" ends: its flag and its why change.
    ended = json.loads(answers.body(store, NOW + 1000, list(items)))
    assert ended == modelled(NOW + 1000, items)
    assert ended["items"][0]["available"] is True and ended["items"][0]["why"] is None
    # An item changes: the body follows at once, whatever the time.
    changed = [items[0], FaultItem("b", 7, NOW + 9000)]
    assert json.loads(answers.body(store, NOW + 1001, changed)) == modelled(NOW + 1001, changed)
    # An earlier `now` than the kept body's (another store's clock): written afresh.
    assert json.loads(answers.body(store, NOW, changed)) == modelled(NOW, changed)
    # Another store keeps its own.
    assert json.loads(answers.body(object(), NOW, items)) == modelled(NOW, items)
