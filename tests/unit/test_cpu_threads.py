"""CPU threads follow the container's CPU limit (cgroup v1 and v2), not the node's core count."""

import subprocess
import sys
from pathlib import Path

import pytest

from goodput_runtime.cpu import cgroup_cpu_limit, pick_threads


def v2(root: Path, text: str) -> Path:
    (root / "cpu.max").write_text(text)
    return root


def v1(root: Path, quota: int, period: int = 100000, folder: str = "cpu,cpuacct") -> Path:
    (root / folder).mkdir()
    (root / folder / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (root / folder / "cpu.cfs_period_us").write_text(f"{period}\n")
    return root


def test_cgroup_v2_quota_is_read(tmp_path):
    assert cgroup_cpu_limit(v2(tmp_path, "150000 100000\n")) == 1.5
    assert cgroup_cpu_limit(v2(tmp_path, "max 100000\n")) is None


def test_cgroup_v1_quota_is_read(tmp_path):
    assert cgroup_cpu_limit(v1(tmp_path, 400000)) == 4.0
    unlimited = tmp_path / "unlimited"
    unlimited.mkdir()
    assert cgroup_cpu_limit(v1(unlimited, -1, folder="cpu")) is None


def test_no_cgroup_files_means_no_limit(tmp_path):
    assert cgroup_cpu_limit(tmp_path) is None


@pytest.mark.parametrize(
    ("quota", "cpus", "threads"),
    [
        ("150000 100000", 64, 1),  # 1.5 CPUs on a 64-core node: one thread, never throttled mid-step
        ("400000 100000", 64, 4),
        ("800000 100000", 2, 2),  # a quota above the usable cores: the cores
        ("50000 100000", 64, 1),  # half a CPU still gets one thread
        ("max 100000", 6, 6),  # no limit: every usable core
    ],
)
def test_threads_follow_the_quota(tmp_path, quota, cpus, threads):
    choice = pick_threads(root=v2(tmp_path, quota), cpus=cpus)
    assert choice.threads == threads
    assert ("CPU limit of" in choice.reason) == (not quota.startswith("max"))


def test_tensor_parallel_ranks_share_the_limit(tmp_path):
    assert pick_threads(ranks=2, root=v2(tmp_path, "400000 100000"), cpus=64).threads == 2
    assert pick_threads(ranks=4, root=v2(tmp_path, "200000 100000"), cpus=64).threads == 1


def test_num_threads_overrides(tmp_path):
    choice = pick_threads(3, root=v2(tmp_path, "100000 100000"), cpus=64)
    assert choice.threads == 3 and choice.reason == "--num-threads"


def test_the_command_line_is_read_before_torch_is_loaded():
    # a refused command line or --help answers at once, not after the seconds torch takes to import
    script = "import sys, goodput_runtime.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
