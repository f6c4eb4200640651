"""Engine settings: one dataclass, filled by the command line."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str
    served_model_name: str | None = None
    revision: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # None: the model's own limit
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; CPU default is a quarter of free memory (cgroup-aware)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_offload_bytes: int = 0  # the KV offload tier's bound (engine/kv_offload.py); 0: no tier
    kv_offload_dir: str | None = None  # local directory of the tier's file; None: the system's temporary one
    max_queue: int = 1024
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages the decoder's layers are split into (engine/pipeline.py)
    pipeline_microbatches: int | None = None  # a step's micro-batches through the stages; None: one per stage
    node_rank: int | None = None  # this pod's index in a replica spanning pods; None: from the environment
    nnodes: int | None = None  # pods of the replica; None: from the environment, else 1
    leader_address: str | None = None  # host:port of pod 0's torch.distributed store
    quantization: str = "none"  # none | int8 (weight-only) | int8-w8a8 | fp8
    quantize_lm_head: bool = False
    enforce_eager: bool = False  # on GPU: no CUDA graphs for decode steps
    model_impl: str = "auto"  # auto: the runtime's compact modules where they apply | transformers
    compile: bool = False  # on CPU: torch.compile the compact modules' decoder layers, warmed up at start
    pooling: str | None = None  # embeddings: last | mean; None: the model's default (last for causal LMs)
    num_threads: int | None = None  # CPU intra-op threads per rank; None: from the container's CPU limit
    step_tuning: str = "auto"  # on CPU: time each step size's threads and product form at start | off
    cpu_contention: str = "auto"  # on CPU: steps on one thread while other processes take the cores | off
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral; None: the one the chat template implies
    speculative_method: str | None = None  # ngram | draft; None: no speculative decoding
    num_speculative_tokens: int = 3  # k: tokens proposed per step and sequence
    speculative_model: str | None = None  # the draft model (method draft): same tokenizer as the target
    ngram_min: int = 1  # prompt lookup matches suffixes of ngram_max down to ngram_min tokens
    ngram_max: int = 4
    speculative_max_batch: int | None = None  # speculate up to this many running requests; None: timed at start
    slo_ttft: float | None = None  # seconds; the target waiting prompts are ordered by (slo_schedule.py)
    slo_tpot: float | None = None  # seconds; the target the batch cap keeps online decode steps within
    slo_scheduling: str = "off"  # on: prompts by TTFT deadline, chunks by TPOT slack (service or request targets)
    batch_cap: str = "auto"  # auto: cap batch sequences beside online ones when slo_tpot is set | off
    batch_cap_margin: float = 0.35  # a step may take slo_tpot × (1 − margin)
    enable_lora: bool = False  # LoRA adapters (on with --lora-modules or --enable-lora)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) of adapters loaded at start
    max_loras: int = 4  # adapter slots a step can use (slot 0, the base model, besides)
    max_cpu_loras: int | None = None  # adapters held in memory; None: 4 × max_loras
    max_lora_rank: int = 16
    pinned_loras: tuple[str, ...] = ()  # adapters never dropped from memory, whose slots go last
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    lora_source: str | None = None  # a directory of adapters, one per subdirectory, loaded on first use by name
    # KV hand-off between a prefill and a decode runtime (engine/kv_transfer/)
    kv_transfer_role: str = "none"  # none | prefill | decode | both
    kv_transfer_transport: str = "tcp"  # tcp | local (runtimes in one process: tests)
    kv_transfer_port: int = 8001  # the tcp transport's listen port; 0: a free one
    kv_transfer_host: str | None = None  # the address advertised to peers; None: $POD_IP, else the host's
    kv_lease_seconds: float = 30.0  # a prefill runtime holds a finished prompt's blocks this long at most
    kv_failure_policy: str = "recompute"  # recompute | fail (503 kv_transfer_failed)
    kv_transfer_timeout: float = 10.0  # seconds: the bound on any one hand-off

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
