"""The CPU KV cache is sized from what the container may still use, not the whole machine."""

from __future__ import annotations

from pathlib import Path

from goodput_runtime.engine.kv_cache_size import available_memory, cgroup_memory_headroom

GiB = 1 << 30


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


def test_cgroup_v2_limit_minus_usage(tmp_path: Path) -> None:
    root = write(tmp_path, {"memory.max": str(GiB), "memory.current": str(600 << 20)})
    assert cgroup_memory_headroom(root) == GiB - (600 << 20)
    # a 1 GiB pod on a big machine: the cache must fit the pod, not the machine
    assert available_memory(root) == GiB - (600 << 20)


def test_cgroup_v1_limit_minus_usage(tmp_path: Path) -> None:
    root = write(tmp_path, {"memory/memory.limit_in_bytes": str(2 * GiB), "memory/memory.usage_in_bytes": str(GiB)})
    assert cgroup_memory_headroom(root) == GiB


def test_no_limit_leaves_the_machine_figure(tmp_path: Path) -> None:
    assert cgroup_memory_headroom(write(tmp_path / "v2", {"memory.max": "max", "memory.current": "5"})) is None
    unlimited_v1 = {"memory/memory.limit_in_bytes": str(9223372036854771712), "memory/memory.usage_in_bytes": "5"}
    assert cgroup_memory_headroom(write(tmp_path / "v1", unlimited_v1)) is None
    assert cgroup_memory_headroom(tmp_path / "none") is None
    assert available_memory(tmp_path / "none") > 0


def test_usage_above_the_limit_leaves_nothing(tmp_path: Path) -> None:
    root = write(tmp_path, {"memory.max": str(GiB), "memory.current": str(2 * GiB)})
    assert cgroup_memory_headroom(root) == 0
