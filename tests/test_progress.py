"""The driver's progress line (pipeline/progress.py) without Spark: datagrams in, lines out,
on a clock the test moves."""

from __future__ import annotations

import io
import json

import pytest

from pipeline.progress import HEARTBEAT_S, Progress

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _datagram(p: Progress, part: int, done: int, first_ms: int | None = None,
              last_ms: int | None = None, final: bool = False) -> None:
    body = {"k": p.address.key, "p": part, "a": 0, "n": done, "f": 0, "v": [], "t": None,
            "d": final, "s": first_ms, "e": last_ms}
    assert p.receive(json.dumps(body).encode())


def test_no_line_repeats_a_count_and_none_says_zero_while_tasks_start() -> None:
    """Spark takes seconds to start the tasks: the log used to get "0/10,000" at every
    tick (three times at 1, 6 and 11 s). Now nothing until the first records, a heartbeat
    if that takes HEARTBEAT_S, and then a line only when something changed."""
    clock = Clock()
    out = io.StringIO()
    p = Progress("produce", "records", total=10_000, out=out, clock=clock)
    try:
        ticks = []
        for at in (1, 6, 11, 16):
            clock.t = 100 + at
            ticks.append(p.tick())
        assert ticks == [None] * 4
        clock.t = 100 + HEARTBEAT_S + 1
        heartbeat = p.tick()
        assert heartbeat is not None and heartbeat.startswith(
            "produce: 0/10,000 records (0 %) · waiting for the first records"), heartbeat
        clock.t += 5
        assert p.tick() is None  # still nothing new
        _datagram(p, 0, 400, 1_000, 2_000)
        clock.t += 5
        line = p.tick()
        assert line is not None and line.startswith("produce: 400/10,000 records (4 %) · ")
        clock.t += 5
        assert p.tick() is None  # same counts
        _datagram(p, 1, 100, 1_500, 2_500)
        clock.t += 5
        line = p.tick()
        assert line is not None and line.startswith("produce: 500/10,000 records")
        counts = [ln.split(" ")[1] for ln in (heartbeat, line)]
        assert counts == ["0/10,000", "500/10,000"]
    finally:
        p.close()


def test_the_final_rate_is_the_summarys_sends_over_the_time_spent_sending() -> None:
    """produce's summary divides the records by (last send's end - first send's start):
    the final line divides by the same span the tasks report, not by the job's wall time
    (which includes Spark's start and the tasks' flush)."""
    clock = Clock()
    p = Progress("produce", "records", total=1_000, out=io.StringIO(), clock=clock)
    try:
        _datagram(p, 0, 500, 10_000, 12_000, final=True)
        _datagram(p, 1, 500, 10_500, 14_000, final=True)
        clock.t += 20  # 20 s of job: starting, sending for 4 s, flushing
        s = p.snapshot()
        assert s.sending_s == 4.0
        final = p.line(s, final=True)
        summary_rate = 1_000 / max(0.001, (14_000 - 10_000) / 1000)
        assert f"{summary_rate:,.0f}/s over 4.0 s sending (20.0 s in all)" in final, final
        assert final.startswith("produce: 1,000/1,000 records (100 %) · 250/s")
    finally:
        p.close()


def test_without_spans_the_final_rate_is_over_the_whole_time() -> None:
    """verify's tasks send no spans: its line keeps the job's own time."""
    clock = Clock()
    p = Progress("verify", "entries read", total=100, out=io.StringIO(), clock=clock)
    try:
        _datagram(p, 0, 100, final=True)
        clock.t += 4
        final = p.line(p.snapshot(), final=True)
        assert "25/s over 4.0 s" in final and "sending" not in final
    finally:
        p.close()
