"""One rank's model: its device, its compute dtype, its weights loaded, cut to its pipeline stage and
sharded."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from goodput_runtime.config import EngineConfig
from goodput_runtime.cpu import pick_threads
from goodput_runtime.engine import parallel, pipeline
from goodput_runtime.engine.config_error import EngineConfigError
from goodput_runtime.engine.pipeline_schedule import MicroBatchSchedule
from goodput_runtime.layers import attention
from goodput_runtime.layers.cpu_dtype import cpu_dtype
from goodput_runtime.layers.quantization import quantize_model
from goodput_runtime.loader import load_config, load_model
from goodput_runtime.models import direct, implementation

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise EngineConfigError("--device cuda was asked for, but no CUDA GPU is visible")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device, model_config, cpu_flags: Iterable[str] | None = None) -> torch.dtype:
    """The compute dtype of weights, activations and the KV cache. auto: float32 on a CPU, the
    checkpoint's bfloat16 or float16 on a GPU (else bfloat16). bfloat16 on a CPU without AVX-512 BF16
    or AMX (cpu_flags: its feature flags, /proc/cpuinfo's when None) falls back to float32 with a
    warning (layers/cpu_dtype.py)."""
    if name != "auto":
        dtype = DTYPES[name]
        return cpu_dtype(dtype, cpu_flags) if device.type == "cpu" else dtype
    if device.type == "cpu":
        return torch.float32
    saved = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    saved = DTYPES.get(str(saved).removeprefix("torch."))
    return saved if saved in (torch.bfloat16, torch.float16) else torch.bfloat16


def load_for_rank(
    config: EngineConfig,
    model_dir: Path,
    rank: int = 0,
    world: int = 1,
    init_method: str | None = None,
    local_rank: int = 0,
) -> tuple[Any, torch.device]:
    """This rank's model: loaded, cut to its pipeline stage and sharded when tensor parallel, on its device."""
    model_config = load_config(model_dir)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device, model_config)
    if device.type == "cpu":
        choice = pick_threads(config.num_threads, world)
        torch.set_num_threads(choice.threads)
        if rank == 0:
            log.info("CPU forward passes use %d intra-op threads per rank (%s)", choice.threads, choice.reason)
    why_not_direct = direct.reason(model_dir, model_config, config.model_impl, world)
    model = None if why_not_direct else direct.load(model_dir, model_config, dtype, device)
    if model is not None:
        log.info("Loaded %s into the runtime's compact modules on %s as %s", model_dir, device, dtype)
        quantize_model(model, config.quantization, device, config.quantize_lm_head)
        return model, device
    if rank == 0:
        log.info("Loading through transformers' model code: %s", why_not_direct or "a tensor missing")
    attn_implementation = attention.register()  # every rank, rank 0 and the followers, loads through here
    if world == 1:
        model = implementation.choose(load_model(model_dir, dtype, device, attn_implementation), config.model_impl)
    else:
        topology = pipeline.Topology(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
        device = parallel.rank_device(device, local_rank)
        assert init_method is not None
        parallel.init_group(rank, world, init_method, device)
        group = parallel.tensor_groups(topology.tensor, topology.pipeline, topology.stage)
        model = load_model(model_dir, dtype, torch.device("cpu"), attn_implementation)
        model = implementation.choose(model, config.model_impl, world)  # transformers' modules: they shard
        pipeline.cut_model(model, topology)
        if topology.tensor > 1:
            parallel.shard_model(model, topology.tensor_rank, topology.tensor, group)
        model = model.to(device)
    quantize_model(model, config.quantization, device, config.quantize_lm_head)
    if config.pipeline_parallel_size > 1:  # the runner runs each step through it (engine/pipeline_schedule.py)
        count = pipeline.microbatches(config.pipeline_microbatches, config.pipeline_parallel_size)
        model.pipeline_schedule = MicroBatchSchedule(model, topology, count)
    return model, device
