"""How two copies of the shared table merge, pure: the rule that makes any discontinuity of
Redis (an empty or older restart, a flush, a failover to a replica that missed writes)
end with Redis and every replica holding the newest of everything.

Every write to the table carries a stamp from a hybrid logical clock (lib/item.lua): a
write's stamp is above every stamp its table gave before and every stamp its writer had
seen. A table restored from an older copy therefore stamps new writes above the ones it
lost, and a replica that still holds a lost write can put it back without undoing a newer
one. The rules:

- the config and each route: the copy with the newer stamp wins;
- a delete (an operator's ``DELETE``) is a grave carrying the delete's stamp: it beats
  every copy stamped before it, so a merge never brings back what was removed; a write
  after the delete is stamped after it and wins;
- a fault item: the later window end wins (windows are extend-only, so a window opened in
  a lost write comes back, and none gets shorter), with the reason it is open (``why``;
  between equal ends, the larger reason by ``_window``'s order); everything else (the
  latency, the votes, the signals, probation, the isolation count, reachability) comes
  from the copy with the newer stamp, ties broken by its stored form.

These are a join: commutative, associative and idempotent, so replicas merging at once, in
any order and as often as they like, converge (tests/test_merge.py checks the laws);
service/store/lua/reseed.lua applies the same rules inside Redis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from detour.model import FaultItem


def merge_items(
    a: FaultItem | None, b: FaultItem | None, encode: Callable[[FaultItem], str]
) -> FaultItem | None:
    """Two copies of one broker's item, merged. ``encode`` is the stored form (``_rest``,
    the tiebreak between copies with one stamp, which only the same write gives)."""
    if a is None:
        return b
    if b is None:
        return a
    newer = a
    # (stored forms only when the stamps tie: a merge of a whole table stays cheap)
    if b.stamp > a.stamp or (b.stamp == a.stamp and _rest(b, encode) > _rest(a, encode)):
        newer = b
    # the window end, and why it is open, come from the copy whose window is later: its
    # own total order (the end, then the reason), so the choice never depends on stamps
    later = b if _window(b) > _window(a) else a
    if later is newer or _window(later) == _window(newer):
        return newer
    return replace(newer, available_at=later.available_at, why=later.why)


def _window(item: FaultItem) -> tuple[int, tuple[str | int, ...]]:
    """A copy's window in the order a merge takes the later one by: the end, then, between
    equal ends, the reason (none lowest; then reason, since, latency, producer). Choosing
    the window by its own order, and the rest by the stamp, makes the merge a product of
    two joins, so it stays associative when ends tie and stamps disagree."""
    why = item.why
    key: tuple[str | int, ...] = (
        () if why is None else (why.reason, why.since, why.latency_ms, why.by)
    )
    return item.available_at, key


def _rest(item: FaultItem, encode: Callable[[FaultItem], str]) -> str:
    """The stored form of what a copy says besides its window: the tiebreak between two
    copies with one stamp, so that which one wins does not depend on the window ends."""
    return encode(replace(item, available_at=0, why=None))


def beats_grave(stamp: int, grave: int | None) -> bool:
    """Whether a copy written at ``stamp`` outlives a delete at ``grave`` (None: none)."""
    return grave is None or stamp > grave


def adds_to(theirs: FaultItem | None, mine: FaultItem, encode: Callable[[FaultItem], str]) -> bool:
    """Whether merging ``mine`` into ``theirs`` changes it: what a replica sends in a merge
    (a copy that adds nothing is not sent, so a merge nobody needed costs no writes)."""
    if theirs is None:
        return True
    # the common cases without building stored forms: the same write, or an older copy
    # whose window ends no later
    if mine.stamp == theirs.stamp and mine == theirs:
        return False
    if mine.stamp < theirs.stamp and _window(mine) <= _window(theirs):
        return False
    merged = merge_items(theirs, mine, encode)
    assert merged is not None
    return (
        merged.available_at != theirs.available_at
        or merged.stamp != theirs.stamp
        or (merged.stamp == theirs.stamp and encode(merged) != encode(theirs))
    )
