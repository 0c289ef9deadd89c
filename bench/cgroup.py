"""A CPU cap for one benchmark process, with the cgroup v1 cpu controller.

A Python client cannot offer 5x a Python server's capacity from the other core of a
2-core machine, so ``bench/overload.py`` can shrink the server instead: the service runs
in a cgroup of its own with ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` set, and the load
generator keeps a whole core. The period is short (3,333 µs with a 1,000 µs quota: 0.3
cores) so a throttled service stalls for at most ~2.3 ms at a time rather than the default
period's ~70 ms, which would dominate every latency figure on its own.

Needs root and a writable ``/sys/fs/cgroup/cpu`` (cgroup v1), as on this machine; cgroup
v2's ``cpu.max`` is used when that is what the machine has.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")


class CpuCap:
    """``with CpuCap(quota_us, period_us) as cap: cap.add(pid)``; removed on exit."""

    def __init__(self, quota_us: int, period_us: int, name: str | None = None) -> None:
        if quota_us < 1000:
            raise ValueError("the kernel's smallest CFS quota is 1,000 µs")
        self.quota_us = quota_us
        self.period_us = period_us
        self.name = name or f"detour-bench-{os.getpid()}"
        self.v1 = (V1_ROOT / "cpu.cfs_quota_us").exists()
        self.path = (V1_ROOT if self.v1 else V2_ROOT) / self.name

    @property
    def cores(self) -> float:
        return self.quota_us / self.period_us

    def __enter__(self) -> CpuCap:
        self.path.mkdir(exist_ok=True)
        if self.v1:
            # The period first: a quota larger than the old period is refused otherwise.
            (self.path / "cpu.cfs_period_us").write_text(str(self.period_us))
            (self.path / "cpu.cfs_quota_us").write_text(str(self.quota_us))
        else:
            (self.path / "cpu.max").write_text(f"{self.quota_us} {self.period_us}")
        return self

    def add(self, pid: int) -> None:
        """Move ``pid`` (its threads follow) into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def throttled(self) -> dict[str, int]:
        """The kernel's throttling counters: how often and how long the cap bit."""
        name = "cpu.stat"
        stats: dict[str, int] = {}
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            stats[key] = int(value)
        return stats

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        parent = self.path.parent / "cgroup.procs"
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                parent.write_text(pid)
            except OSError:
                pass  # exited meanwhile
        self.path.rmdir()
