"""How much CPU this process's event loop may use: its cgroup's CPU quota, at most one core.

Why: the shedder (service/edge/shedding.py) keeps shedding while the event loop is saturated,
and judges that by the share it uses of the CPU it may use. Under a CPU limit (a
Kubernetes ``resources.limits.cpu``, a cgroup quota) a saturated process uses only its
quota, the kernel throttling the rest, so CPU time over wall time alone cannot tell a
throttled process from a half-idle one. One event loop uses at most one core, whatever
the quota.

The quota is read from the files the kernel keeps: ``/proc/self/cgroup`` names the
process's group; cgroup v2's ``cpu.max`` or v1's ``cpu.cfs_quota_us`` and
``cpu.cfs_period_us`` hold the quota. A group can be changed while the process runs
(in-place resize, a benchmark's cap), so ``CpuShare`` reads them again at most once a
second. Anything missing or unreadable means no quota: the CPUs the process may run
on, shared by its workers, at most one core each.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

#: Where the kernel mounts the cgroup filesystems.
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
_REREAD_NS = 1_000_000_000


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def quota_cores(proc_cgroup: str, root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of the group ``proc_cgroup`` (the text of ``/proc/self/cgroup``)
    names, in cores; None when there is none (or it cannot be read)."""
    for line in proc_cgroup.splitlines():
        _, _, rest = line.partition(":")
        controllers, _, group = rest.partition(":")
        group = group.lstrip("/")
        if controllers == "":  # cgroup v2: "0::/path"
            # Without a cgroup namespace the path is the host's, and the container sees
            # its own group at the mount's root.
            text = _read(root / group / "cpu.max") or _read(root / "cpu.max")
            if text is None:
                continue
            quota, _, period = text.partition(" ")
            if quota == "max" or not period:
                return None
            return int(quota) / int(period)
        if "cpu" in controllers.split(","):  # cgroup v1: "4:cpu,cpuacct:/path"
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                for base in (root / mount / group, root / mount):
                    quota_text = _read(base / "cpu.cfs_quota_us")
                    period_text = _read(base / "cpu.cfs_period_us")
                    if quota_text is None or period_text is None:
                        continue
                    quota_us = int(quota_text)
                    return None if quota_us < 0 else quota_us / int(period_text)
    return None


def _cpus() -> int:
    """The CPUs this process may run on (its affinity), at least one."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class CpuShare:
    """The cores this process's event loop may use (``cores()``), re-read once a second.

    ``workers`` processes share the quota (or the CPUs) equally: uvicorn's workers all
    run in the same pod."""

    def __init__(
        self,
        workers: int = 1,
        root: Path = CGROUP_ROOT,
        proc_cgroup: Path = PROC_CGROUP,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        cpus: Callable[[], int] = _cpus,
    ) -> None:
        self._workers = max(1, workers)
        self._root = root
        self._proc = proc_cgroup
        self._clock = clock_ns
        self._cpus = cpus
        self._cores = 1.0
        self._read_at: int | None = None

    def cores(self) -> float:
        now = self._clock()
        if self._read_at is None or now - self._read_at >= _REREAD_NS:
            self._read_at = now
            text = _read(self._proc)
            quota = quota_cores(text, self._root) if text is not None else None
            available = float(self._cpus()) if quota is None else quota
            self._cores = max(0.001, min(1.0, available / self._workers))
        return self._cores
