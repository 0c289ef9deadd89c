"""policy.quiet: which reports a replica may keep local (docs/semantics.md). Pure."""

from __future__ import annotations

import pytest

from detour import policy
from detour.model import Config, FaultItem
from tests.rule import applied

pytestmark = pytest.mark.unit

NOW = 1_700_000_000_000
ENDED = FaultItem("b", 20, NOW - 1000)
OPEN = FaultItem("b", 700, NOW + 30_000)


@pytest.mark.parametrize(
    ("old", "latency", "isolation", "config", "kept"),
    [
        (ENDED, 20, False, Config(), True),  # a healthy send
        (OPEN, 20, False, Config(), True),  # extend: max(old end, at) leaves the window
        (ENDED, 549, False, Config(), True),  # below the first tier with a window
        (ENDED, 550, False, Config(), False),  # opens a 30 s window
        (OPEN, 700, False, Config(), False),  # may extend it
        (ENDED, 20, True, Config(), False),  # a failure: a vote, a window
        (None, 20, False, Config(), False),  # a new broker: its item, the cap
        (FaultItem("b", 20, NOW - 1000, probation=True), 20, False, Config(), False),
        (OPEN, 20, False, Config(last_report_wins=True), False),  # ends the window
        (ENDED, 20, False, Config(last_report_wins=True), True),
        # a producer's own slow window (latencyQuorum) that its fast answer may end
        (FaultItem("b", 20, NOW - 1000, slow=(("p", NOW - 500, NOW + 29_500),)), 20, False,
         Config(last_report_wins=True, latency_quorum=2), False),
        (FaultItem("b", 20, NOW - 1000, slow=(("p", NOW - 500, NOW + 29_500),)), 20, False,
         Config(latency_quorum=2), True),  # extend: the vote and its window stay
        (None, 20, False, Config(send_latency_fault_enable=False), True),  # only logged
        (None, 20, True, Config(send_latency_fault_enable=False), False),  # failures logged
    ],
)
def test_quiet(
    old: FaultItem | None, latency: int, isolation: bool, config: Config, kept: bool
) -> None:
    assert policy.quiet(old, latency, isolation, NOW, config) is kept


def test_a_kept_report_would_have_changed_no_window_in_the_pure_core() -> None:
    """Whatever the store held (ended, open, or a longer window the copy has not heard
    of), a report policy.quiet keeps leaves the window end where the one rule would."""
    config = Config()
    for held in (ENDED, OPEN, FaultItem("b", 20, NOW + 600_000)):
        for latency in range(0, 550, 7):
            assert policy.quiet(ENDED, latency, False, NOW, config)
            out = applied(held, "b", latency, False, None, "p", NOW, NOW, config)
            assert out.item is not None
            assert out.item.available_at == max(held.available_at, NOW)
            assert out.duration_ms == 0
