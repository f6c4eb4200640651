"""Assembling an engine from its settings: model, tokenizer, KV cache size, scheduler."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.core import EngineCore
from goodput_runtime.engine.model_runner import KVLayout, ModelRunner
from goodput_runtime.engine.scheduler import Scheduler
from goodput_runtime.loader import ModelLoadError, load_model, load_tokenizer, resolve_model_path
from goodput_runtime.metrics import RuntimeMetrics

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_CAP = 4 << 30


class EngineConfigError(ValueError):
    """The settings cannot work together on this machine and model."""


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise EngineConfigError("--device cuda was asked for, but no CUDA GPU is visible")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device, model_config) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    saved = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    saved = DTYPES.get(str(saved).removeprefix("torch."))
    return saved if saved in (torch.bfloat16, torch.float16) else torch.bfloat16


def available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


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


def build_core(config: EngineConfig, metrics: RuntimeMetrics | None = None) -> EngineCore:
    model_dir = resolve_model_path(config.model, config.revision)
    device = pick_device(config.device)
    tokenizer = load_tokenizer(model_dir)
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(model_dir)
    dtype = pick_dtype(config.dtype, device, model_config)
    model = load_model(model_dir, dtype, device)

    limit = getattr(model_config, "max_position_embeddings", None) or config.max_model_len or 2048
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:
        raise EngineConfigError(f"--max-model-len {max_model_len} exceeds the model's limit of {limit} tokens")

    layout = KVLayout.of(model_config, dtype)
    block_bytes = layout.bytes_per_token() * config.block_size
    num_blocks = kv_cache_bytes(config, device, model_config) // block_bytes
    tokens = num_blocks * config.block_size
    if tokens < max_model_len:
        raise EngineConfigError(
            f"the KV cache holds {tokens} tokens ({num_blocks * block_bytes / 2**20:.1f} MiB), fewer than "
            f"--max-model-len {max_model_len}; give it more memory (--kv-cache-memory on CPU, "
            f"--gpu-memory-utilization on GPU) or lower --max-model-len"
        )
    log.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB, %d bytes per token); "
             "%.1f sequences of %d tokens fit at once",
             num_blocks, config.block_size, tokens, num_blocks * block_bytes / 2**20,
             layout.bytes_per_token(), tokens / max_model_len, max_model_len)

    eos = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, list):
            eos.update(source)
    block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
    scheduler = Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                          frozenset(eos))
    runner = ModelRunner(model, num_blocks, config.block_size, config.seed)
    return EngineCore(runner, scheduler, tokenizer, max_model_len, metrics)


__all__ = ["EngineConfigError", "ModelLoadError", "build_core"]
