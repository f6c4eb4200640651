"""How many KV cache blocks a rank holds: the memory left on the GPU, or a share of what the machine
and its container leave on a CPU."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine import pipeline
from goodput_runtime.engine.config_error import EngineConfigError
from goodput_runtime.engine.step import KVLayout

log = logging.getLogger(__name__)

CPU_KV_CACHE_CAP = 4 << 30


def available_memory(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Memory this process may still use: the machine's available memory, or less when a
    container's memory limit (cgroup v2 or v1) leaves less room."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    headroom = cgroup_memory_headroom(cgroup_root)
    return min(available, headroom) if headroom is not None else available


def cgroup_memory_headroom(root: Path) -> int | None:
    """The cgroup's memory limit minus its usage, or None where no limit is set."""
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            limit_text = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 1 << 60:  # v1 spells "no limit" as a huge number
            return None
        return max(int(limit_text) - usage, 0)
    return None


def kv_cache_bytes(config: EngineConfig, device: torch.device, model_config) -> int:
    if device.type != "cuda":
        return config.kv_cache_memory or min(available_memory() // 4, CPU_KV_CACHE_CAP)
    free, total = torch.cuda.mem_get_info(device)
    cfg = model_config
    # activations of one full step, generously: hidden states, MLP and logits per token
    per_token = (4 * cfg.hidden_size + 2 * cfg.intermediate_size + cfg.vocab_size) * 4
    reserve = config.max_num_batched_tokens * per_token
    budget = int(total * config.gpu_memory_utilization) - (total - free) - reserve
    if config.kv_cache_memory:
        budget = min(budget, config.kv_cache_memory)
    return max(int(budget), 0)


def size_kv_cache(
    config: EngineConfig, device: torch.device, model_config, dtype: torch.dtype, max_model_len: int
) -> int:
    """Blocks of this rank's KV cache; refuses a cache that cannot hold one full-length sequence."""
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    layout = KVLayout.of(model_config, dtype, config.tensor_parallel_size)
    if config.pipeline_parallel_size > 1:  # a rank holds its stage's layers alone (the first stage's are the most)
        stage = pipeline.stage_layers(model_config.num_hidden_layers, config.pipeline_parallel_size, 0)
        layout = dataclasses.replace(layout, num_layers=len(stage))
    block_bytes = layout.bytes_per_token() * config.block_size
    budget = kv_cache_bytes(config, device, model_config)
    if device.type != "cuda":
        budget //= world  # on CPU the budget is the whole cache, shared out by KV heads
    num_blocks = budget // block_bytes  # the runner adds one scratch block beyond these
    tokens = num_blocks * config.block_size
    if tokens < max_model_len:
        raise EngineConfigError(
            f"the KV cache holds {tokens} tokens ({num_blocks * block_bytes * world / 2**20:.1f} MiB), fewer than "
            f"--max-model-len {max_model_len}; give it more memory (--kv-cache-memory on CPU, "
            f"--gpu-memory-utilization on GPU) or lower --max-model-len"
        )
    log.info(
        "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB, %d bytes per token%s); "
        "%.1f sequences of %d tokens fit at once",
        num_blocks,
        config.block_size,
        tokens,
        num_blocks * block_bytes * world / 2**20,
        layout.bytes_per_token() * world,
        f", split over {world} ranks" if world > 1 else "",
        tokens / max_model_len,
        max_model_len,
    )
    return num_blocks
