"""Assembling an engine from its settings: model, tokenizer, KV cache, scheduler, and the optional
parts (LoRA slots, the KV offload tier) it attaches."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from typing import Any

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine import lora_manager, lora_options, parallel, pipeline, prefix_digest, rendezvous
from goodput_runtime.engine.batch_cap import BatchCap, StepTimeModel
from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.config_error import EngineConfigError
from goodput_runtime.engine.contention import ContentionWatch
from goodput_runtime.engine.core import EngineCore
from goodput_runtime.engine.kv_cache_size import size_kv_cache
from goodput_runtime.engine.kv_events import KvEvents
from goodput_runtime.engine.lora_manager import LoraError, LoraManager
from goodput_runtime.engine.model_runner import ModelRunner
from goodput_runtime.engine.rank_model import load_for_rank, pick_device
from goodput_runtime.engine.scheduler import Scheduler
from goodput_runtime.engine.slo_schedule import SloSchedule
from goodput_runtime.engine.speculation_setup import configure_speculation
from goodput_runtime.engine.step_tuning import tune_runner
from goodput_runtime.engine.warm_up import compile_layers, warm_up_triton
from goodput_runtime.layers import attention, triton_linear
from goodput_runtime.layers.quantization import check_method
from goodput_runtime.loader import ModelLoadError, check_architecture, load_config, load_tokenizer, resolve_model_path
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.models.llama import CausalLM
from goodput_runtime.sampling import generation_defaults

log = logging.getLogger(__name__)


def enable_lora(config: EngineConfig, model: Any, model_config, metrics: RuntimeMetrics | None = None) -> LoraManager:
    """The model's LoRA slots, allocated (and logged) before the KV cache is sized from what memory is
    left, and the adapters of --lora-modules read into them."""
    if not isinstance(model, CausalLM):
        raise EngineConfigError(
            "LoRA adapters need the runtime's own modules (Llama, Mistral, Qwen2; no --model-impl transformers, "
            "no --tensor-parallel-size above 1)"
        )
    if config.compile:
        raise EngineConfigError("--compile does not run LoRA adapters yet: leave one of them off")
    if config.max_loras < 1 or config.max_lora_rank < 1:
        raise EngineConfigError("--max-loras and --max-lora-rank must be at least 1")
    targets = model.enable_lora(config.max_loras + 1, config.max_lora_rank)
    shape = lora_manager.model_shape(model_config, config.model_name)
    cpu = config.max_cpu_loras if config.max_cpu_loras is not None else 4 * config.max_loras
    lora_metrics = metrics.enable_lora(config.max_loras) if metrics is not None else None
    on_event = None
    if lora_metrics is not None:

        def on_event(event: str, name: str) -> None:
            lora_metrics.record_eviction("slot" if event == "evict_slot" else "cpu")

    manager = LoraManager(targets, shape, config.max_loras, cpu, config.max_lora_rank, on_event)
    log.info(
        "LoRA: %d adapter slots of rank up to %d reserve %.1f MiB before the KV cache is sized; "
        "up to %d adapters held in memory",
        config.max_loras,
        config.max_lora_rank,
        manager.slot_bytes / 2**20,
        manager.max_cpu_loras,
    )
    for name, path in config.lora_modules:
        started = time.monotonic()
        try:
            manager.add(manager.read(name, path), pinned=name in config.pinned_loras)
        except LoraError as e:
            raise EngineConfigError(f"--lora-modules {name}={path}: {e}") from e
        if lora_metrics is not None:
            lora_metrics.record_load("ok", time.monotonic() - started)
    return manager


def enable_kv_offload(config: EngineConfig, runner: ModelRunner, block_manager: BlockManager, world: int) -> None:
    """The KV offload tier (engine/kv_offload.py) behind the block manager and the runner."""
    from goodput_runtime.engine.kv_offload import OffloadStore, ReloadPolicy

    if world > 1:
        raise EngineConfigError("--kv-offload-bytes does not run with tensor or pipeline parallelism yet")
    if not config.enable_prefix_caching:
        raise EngineConfigError("--kv-offload-bytes needs prefix caching (it keeps prefix blocks)")
    shape = runner.block_payload_shape()
    entry_bytes = math.prod(shape) * runner.dtype.itemsize
    try:
        store = OffloadStore(config.kv_offload_dir, config.kv_offload_bytes, entry_bytes)
    except (ValueError, OSError) as e:
        raise EngineConfigError(f"--kv-offload-bytes: {e}") from e
    block_manager.offload = store
    block_manager.reload_policy = ReloadPolicy(store)
    runner.offload = store
    log.info(
        "KV offload tier: %d blocks of %d bytes in %s (%d bytes at most)",
        store.num_slots,
        entry_bytes,
        store.path,
        config.kv_offload_bytes,
    )


def build_core(config: EngineConfig, metrics: RuntimeMetrics | None = None) -> EngineCore:
    if (refused := lora_options.refusal(config)) is not None:  # by name, before any weight is loaded
        raise EngineConfigError(refused)
    if refused := pipeline.microbatch_problem(config.pipeline_microbatches, config.pipeline_parallel_size):
        raise EngineConfigError(refused)
    model_dir = resolve_model_path(config.model, config.revision)
    check_architecture(model_dir)
    model_config = load_config(model_dir)
    limit = getattr(model_config, "max_position_embeddings", None) or config.max_model_len or 2048
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:
        raise EngineConfigError(f"--max-model-len {max_model_len} exceeds the model's limit of {limit} tokens")
    tensor = config.tensor_parallel_size
    world = tensor * config.pipeline_parallel_size
    check_method(config.quantization, pick_device(config.device))  # before any rank or weight is loaded
    followers = None
    init_method = None
    group = rendezvous.group_of(config.node_rank, config.nnodes, config.leader_address)
    if group.node_rank != 0:
        raise EngineConfigError("a worker pod (--node-rank above 0) serves no requests; it runs serve_node")
    if world > 1:
        per_node = group.ranks_per_node(world)
        parallel.validate(model_config, tensor, pick_device(config.device), config.pipeline_parallel_size, per_node)
        if config.pipeline_parallel_size > 1 and config.speculative_method:
            raise EngineConfigError("--speculative-method does not run with --pipeline-parallel-size above 1 yet")
        if group.nnodes == 1:
            init_method = f"tcp://127.0.0.1:{parallel.free_port()}"
        else:
            init_method = group.init_method
            rendezvous.GroupWatch(group).wait_for_workers()
        followers = parallel.Followers(
            list(range(1, per_node)), world, init_method, model_dir, json.dumps(dataclasses.asdict(config))
        )
    elif group.nnodes > 1:
        raise EngineConfigError(f"--nnodes {group.nnodes} needs as many ranks at least (tensor × pipeline is 1)")
    tokenizer = load_tokenizer(model_dir)
    model, device = load_for_rank(config, model_dir, 0, world, init_method)
    dtype = model.get_input_embeddings().weight.dtype
    wanted = config.enable_lora or config.lora_modules or config.lora_source
    lora = enable_lora(config, model, model_config, metrics) if wanted else None
    num_blocks = size_kv_cache(config, device, model_config, dtype, max_model_len)

    eos = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, list):
            eos.update(source)
    salt = prefix_digest.model_salt(config.model, config.revision, str(dtype).removeprefix("torch."))
    block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, salt)
    scheduler = Scheduler(
        block_manager, config.max_num_seqs, config.max_num_batched_tokens, max_model_len, frozenset(eos)
    )
    scheduler.lora = lora
    if config.slo_tpot is not None and config.batch_cap != "off":
        scheduler.batch_cap = BatchCap(config.slo_tpot, config.batch_cap_margin)
        log.info(
            "Batch work beside online requests is capped so a step stays within %.3fs (TPOT target %gs less %g%%)",
            scheduler.batch_cap.budget,
            config.slo_tpot,
            100 * config.batch_cap_margin,
        )
    if config.slo_scheduling == "on":  # the service's targets, or only requests' own (x-goodput-slo-*)
        model_of_steps = scheduler.batch_cap.model if scheduler.batch_cap is not None else StepTimeModel()
        scheduler.slo = SloSchedule(
            config.slo_ttft, config.slo_tpot, max_chunk=config.max_num_batched_tokens, model=model_of_steps
        )
        log.info("Scheduling for the SLO: waiting prompts by TTFT deadline, online prefill chunks by TPOT slack")
    runner = ModelRunner(model, num_blocks, config.block_size, config.seed, tensor)
    if config.kv_offload_bytes:
        enable_kv_offload(config, runner, block_manager, world)
    if config.enable_prefix_caching:  # the blocks held per tier, published (engine/kv_events.py)
        block_manager.events = KvEvents(config.block_size)
        block_manager.listeners.append(block_manager.events.record)
        if block_manager.offload is not None:
            block_manager.offload.listeners.append(block_manager.events.record)
        if metrics is not None:
            metrics.watch_kv_tiers(block_manager)
    if followers is not None:
        parallel.broadcast(num_blocks)
        runner.broadcast = parallel.broadcast
    if runner.plan is not None and config.step_tuning == "auto":
        tune_runner(runner, config.max_num_seqs)  # before speculation's timing, which then times tuned steps
    if device.type == "cuda" and world == 1 and not config.enforce_eager:
        # under the decode graphs only: launched eagerly, a Triton kernel's Python launch costs more
        # than cuBLAS's. Before compiling: the compiled graph for one token calls it.
        triton_linear.enable(runner.model, device)
    if config.compile:
        compile_layers(runner)  # after tuning (whose trial plans would each compile), before CUDA graphs
    if device.type == "cuda" and attention.kernel_attends_decodes(runner.cache):
        warm_up_triton(runner, model_config, tensor)
    if device.type == "cuda" and not config.enforce_eager and lora is not None:
        log.info("decode CUDA graphs are off with LoRA adapters; decode steps run eagerly")
    elif device.type == "cuda" and not config.enforce_eager:
        if world == 1:
            runner.enable_decode_graphs(config.max_num_seqs, max_model_len, capture=True)
        else:
            log.info("decode CUDA graphs are off under tensor parallelism; decode steps run eagerly")
    if runner.plan is not None and config.cpu_contention == "auto":
        runner.watch = ContentionWatch(on_switch=metrics.cpu_contention_changed if metrics else None)
    if config.speculative_method:
        configure_speculation(config, runner, scheduler, metrics, model_config, num_blocks)
    defaults = generation_defaults(getattr(model, "generation_config", None))  # for requests silent on them
    return EngineCore(runner, scheduler, tokenizer, max_model_len, metrics, followers, defaults)


__all__ = ["EngineConfigError", "ModelLoadError", "build_core"]
