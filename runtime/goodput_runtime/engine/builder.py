"""Assembling an engine from its settings: model, tokenizer, KV cache size, scheduler."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from goodput_runtime.config import EngineConfig
from goodput_runtime.cpu import pick_threads
from goodput_runtime.engine import lora_manager, lora_options, parallel, pipeline, prefix_digest, rendezvous
from goodput_runtime.engine.batch_cap import BatchCap, StepTimeModel
from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.contention import ContentionWatch
from goodput_runtime.engine.core import EngineCore
from goodput_runtime.engine.kv_events import KvEvents
from goodput_runtime.engine.lora_manager import LoraError, LoraManager
from goodput_runtime.engine.model_runner import ModelRunner
from goodput_runtime.engine.scheduler import Scheduler
from goodput_runtime.engine.slo_schedule import SloSchedule
from goodput_runtime.engine.spec_decode.draft import DraftProposer
from goodput_runtime.engine.spec_decode.ngram import NgramProposer
from goodput_runtime.engine.spec_decode.switch import SpeculationSwitch, measure_max_batch, step_costs, timer
from goodput_runtime.engine.step import KVLayout
from goodput_runtime.engine.step_tuning import tune_runner
from goodput_runtime.layers import attention, triton_attention, triton_linear
from goodput_runtime.layers.cpu_dtype import cpu_dtype
from goodput_runtime.layers.quantization import check_method, quantize_model
from goodput_runtime.loader import (
    ModelLoadError,
    check_architecture,
    load_config,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.models import implementation
from goodput_runtime.models.llama import COMPILED_MAX_TOKENS, CausalLM
from goodput_runtime.sampling import generation_defaults

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
    return model, device


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


def warm_up_triton(runner: ModelRunner, model_config, world: int) -> None:
    """The CUDA decode attention kernels' variants compiled now (triton_attention.warm_up), for each
    window the model's layers use, so that the first steps mixing decodes and prompts wait for none."""
    started, layout = time.monotonic(), runner.layout
    heads = model_config.num_attention_heads // world
    for window in {None, getattr(model_config, "sliding_window", None)}:
        triton_attention.warm_up(
            heads, layout.kv_heads, layout.head_dim, runner.block_size, layout.dtype, runner.device, window
        )
    log.info("compiled the Triton decode attention kernels in %.1f s", time.monotonic() - started)


def compile_layers(runner: ModelRunner) -> None:
    """torch.compile the compact modules' stack of layers and compile it now, with a step of each
    size whose projections take another form under the step plan, so no request waits for it."""
    model = runner.model
    reason = (
        "the model runs on transformers' modules" if not hasattr(model, "compile_layers") else model.compile_layers()
    )
    if reason is not None:
        log.info("--compile left off: %s", reason)
        return
    started = time.monotonic()
    sizes = {1, 2}
    if runner.plan is not None:
        sizes |= {n for n in (*runner.plan.counts, runner.plan.limit + 1) if n <= COMPILED_MAX_TOKENS}
    runner.warm_up(sorted(sizes))
    log.info(
        "compiled the decoder layers in %.1f s (steps of up to %d tokens; larger ones run eagerly)",
        time.monotonic() - started,
        COMPILED_MAX_TOKENS,
    )


def configure_speculation(
    config: EngineConfig,
    runner: ModelRunner,
    scheduler: Scheduler,
    metrics: RuntimeMetrics | None,
    model_config,
    num_blocks: int,
) -> None:
    """The proposer (prompt lookup, or the draft model with a KV cache of as many tokens as the
    target's) and the switch, its threshold timed here unless --speculative-max-batch gives it."""
    k = config.num_speculative_tokens
    draft: ModelRunner | None = None
    if config.speculative_method == "draft":
        assert config.speculative_model
        draft_dir = resolve_model_path(config.speculative_model, None)
        check_architecture(draft_dir)
        draft_config = load_config(draft_dir)
        if draft_config.vocab_size != model_config.vocab_size:
            raise EngineConfigError(
                f"--speculative-model has a vocabulary of {draft_config.vocab_size} tokens, the "
                f"model {model_config.vocab_size}: a draft model needs the model's tokenizer"
            )
        draft_model, _ = load_for_rank(dataclasses.replace(config, quantization="none"), draft_dir)
        draft = ModelRunner(draft_model, num_blocks, config.block_size, config.seed)
        runner.proposer = DraftProposer(draft, BlockManager(num_blocks, config.block_size, False), k)
        log.info("Loaded the draft model %s (%d layers)", config.speculative_model, draft_config.num_hidden_layers)
    else:
        # timed at start-up like the switch: the proposal length is chosen per proposal from what steps of
        # 1..k + 1 tokens cost; with --speculative-max-batch nothing is timed and every match proposes k
        costs = step_costs(timer(runner.time_step), k) if config.speculative_max_batch is None else None
        runner.proposer = NgramProposer(k, config.ngram_min, config.ngram_max, costs)
        if costs is not None:
            log.info(
                "Prompt lookup: a step of 1..%d tokens for one sequence costs %s times one of 1 token",
                k + 1,
                ", ".join(map(str, costs)),
            )
    max_batch = config.speculative_max_batch
    if max_batch is None:

        def step(batch: int, tokens: int) -> None:
            runner.time_step(batch, tokens)
            if draft is not None and tokens > 1:  # a verification's proposals cost k draft steps
                for _ in range(k):
                    draft.time_step(batch, 1)

        max_batch, ratios = measure_max_batch(timer(step), k, config.max_num_seqs)
        log.info(
            "Speculative decoding timed: a step of %d tokens per sequence costs %s times one of 1 token "
            "(by running batch); it pays up to %d running requests",
            k + 1,
            ", ".join(f"{b}: {r}" for b, r in ratios.items()),
            max_batch,
        )
    scheduler.switch = SpeculationSwitch(max_batch)
    if metrics is not None:
        metrics.speculation_configured(max_batch, k)
    log.info(
        "Speculative decoding: %s, %d tokens per step, on up to %d running requests%s",
        config.speculative_method,
        k,
        max_batch,
        "; verification steps run eagerly, beside the decode CUDA graphs" if runner.device.type == "cuda" else "",
    )


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
    if config.slo_scheduling == "on" and (config.slo_ttft is not None or config.slo_tpot is not None):
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
