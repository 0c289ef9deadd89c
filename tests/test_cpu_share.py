"""The CPU a process's event loop may use, read from its cgroup (service/edge/cpu_share.py).

The kernel's files are laid out in a temporary directory as cgroup v1 and v2 mount
them; the module reads whichever the process's ``/proc/self/cgroup`` names.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from service.edge.cpu_share import CpuShare, quota_cores


def v1(root: Path, group: str, quota: int, period: int, mount: str = "cpu") -> str:
    base = root / mount / group.lstrip("/")
    base.mkdir(parents=True, exist_ok=True)
    (base / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (base / "cpu.cfs_period_us").write_text(f"{period}\n")
    return f"12:memory:/other\n4:{mount}:{group}\n0::/\n"


def v2(root: Path, group: str, text: str) -> str:
    base = root / group.lstrip("/")
    base.mkdir(parents=True, exist_ok=True)
    (base / "cpu.max").write_text(text + "\n")
    return f"0::{group}\n"


def test_cgroup_v1_quota_in_cores(tmp_path: Path) -> None:
    proc = v1(tmp_path, "/detour-bench-1", 1000, 3333)
    assert quota_cores(proc, tmp_path) == pytest.approx(0.30003, rel=1e-4)


def test_cgroup_v1_joined_controllers(tmp_path: Path) -> None:
    proc = v1(tmp_path, "/kubepods/pod1/c1", 50_000, 100_000, mount="cpu,cpuacct")
    assert quota_cores(proc, tmp_path) == 0.5


def test_cgroup_v1_without_a_quota(tmp_path: Path) -> None:
    assert quota_cores(v1(tmp_path, "/", -1, 100_000), tmp_path) is None


def test_cgroup_v2_quota_and_max(tmp_path: Path) -> None:
    assert quota_cores(v2(tmp_path, "/pod/c", "150000 100000"), tmp_path) == 1.5
    assert quota_cores(v2(tmp_path, "/pod/d", "max 100000"), tmp_path) is None


def test_a_host_path_falls_back_to_the_containers_own_group(tmp_path: Path) -> None:
    """Without a cgroup namespace /proc/self/cgroup names the host's path, and the
    container's group is mounted at the root."""
    v2(tmp_path, "/", "50000 100000")
    assert quota_cores("0::/kubepods.slice/pod1/c1\n", tmp_path) == 0.5
    v1(tmp_path / "v1", "/", 25_000, 100_000)
    assert quota_cores("4:cpu:/kubepods/pod1/c1\n", tmp_path / "v1") == 0.25


def test_missing_or_unreadable_files_mean_no_quota(tmp_path: Path) -> None:
    assert quota_cores("0::/nowhere\n", tmp_path) is None
    assert quota_cores("4:cpu:/nowhere\n", tmp_path) is None
    assert quota_cores("", tmp_path) is None


def test_the_share_is_at_most_one_core_and_read_again_each_second(tmp_path: Path) -> None:
    proc_file = tmp_path / "cgroup"
    root = tmp_path / "fs"
    proc_file.write_text(v2(root, "/app", "300000 100000"))
    now = [0]
    share = CpuShare(root=root, proc_cgroup=proc_file, clock_ns=lambda: now[0], cpus=lambda: 8)
    assert share.cores() == 1.0  # 3 cores of quota: one event loop uses one
    (root / "app" / "cpu.max").write_text("30000 100000\n")
    now[0] = 999_000_000
    assert share.cores() == 1.0  # not read again within the second
    now[0] = 1_000_000_000
    assert share.cores() == pytest.approx(0.3)
    proc_file.unlink()
    now[0] = 2_000_000_000
    assert share.cores() == 1.0  # nothing readable: no quota, and 8 CPUs


def test_workers_share_the_quota_or_the_cpus(tmp_path: Path) -> None:
    proc_file = tmp_path / "cgroup"
    root = tmp_path / "fs"
    proc_file.write_text(v2(root, "/app", "100000 100000"))
    assert CpuShare(4, root, proc_file).cores() == 0.25  # one core of quota, four workers
    nowhere = tmp_path / "none"
    assert CpuShare(4, root, nowhere, cpus=lambda: 2).cores() == 0.5  # no quota, 2 CPUs
    assert CpuShare(1, root, nowhere, cpus=lambda: 2).cores() == 1.0
