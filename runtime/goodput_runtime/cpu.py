"""How many threads a CPU forward pass may use: the container's CPU limit, not the node's core count.

torch starts one intra-op thread per core it sees. In a pod with a CPU limit on a large node
that is far more threads than the CFS quota pays for: every step then runs until the quota is
spent and stalls for the rest of the period. The runtime sizes its pool from the cgroup's quota
(v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded down, and never above the
cores this process may run on; `--num-threads` overrides the choice.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup's quota allows (1.5 for 150000/100000), or None where no quota is set."""
    try:  # cgroup v2
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for v1 in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        try:
            quota_us = int((root / v1 / "cpu.cfs_quota_us").read_text())
            period_us = int((root / v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def usable_cpus() -> int:
    """Cores this process may be scheduled on (its affinity mask, which cpusets narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str


def pick_threads(
    requested: int | None = None, ranks: int = 1, root: Path = CGROUP_ROOT, cpus: int | None = None
) -> ThreadChoice:
    """Intra-op threads for each of `ranks` processes sharing this container."""
    if requested:
        return ThreadChoice(requested, "--num-threads")
    cpus = cpus or usable_cpus()
    limit = cgroup_cpu_limit(root)
    if limit is None:
        total, why = cpus, f"{cpus} usable cores, no CPU limit"
    else:
        total = max(1, min(cpus, math.floor(limit)))
        why = f"the container's CPU limit of {limit:g} on {cpus} usable cores"
    if ranks > 1:
        return ThreadChoice(max(1, total // ranks), f"{why}, shared by {ranks} tensor-parallel ranks")
    return ThreadChoice(total, why)
