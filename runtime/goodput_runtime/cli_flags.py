"""The runtime's flags: ``python -m goodput_runtime --help``. Each engine flag's default is its
EngineConfig field's."""

from __future__ import annotations

import argparse

from goodput_contract import quantization as quantization_rules
from goodput_runtime.cli_types import (
    TERMINATION_MESSAGE_PATH,
    DefaultsHelpFormatter,
    ReasonedArgumentParser,
    byte_size,
    default,
    fraction,
    lora_module,
    margin_fraction,
    non_negative_int,
    port_number,
    positive_int,
    positive_seconds,
    seconds,
)


def build_parser() -> ReasonedArgumentParser:
    p = ReasonedArgumentParser(
        prog="python -m goodput_runtime", description=__doc__, formatter_class=DefaultsHelpFormatter
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        required=True,
        help="local model directory, a .gguf file (or a directory holding one), a Hugging Face id "
        "(org/name) or one GGUF file of a Hub repository (hf://org/name/file.gguf)",
    )
    model.add_argument("--served-model-name", help="the name clients send as 'model' (default: --model)")
    model.add_argument("--revision", help="Hugging Face revision (branch, tag or commit)")
    model.add_argument(
        "--dtype",
        default=default("dtype"),
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights, activations and KV cache; auto: float32 on CPU, the checkpoint's bf16/fp16 on GPU. "
        "bfloat16 on CPU needs AVX-512 BF16 or AMX and runs in float32, with a warning, where the CPU has neither",
    )
    model.add_argument("--device", default=default("device"), choices=["auto", "cpu", "cuda"])
    model.add_argument("--max-model-len", type=positive_int, help="context length (default: the model's)")
    model.add_argument(
        "--quantization",
        default="none",
        choices=list(quantization_rules.METHODS),
        help="int8: weight-only int8 with per-channel scales (closest to the unquantized model); "
        "int8-w8a8: int8 weights and per-token int8 activations (faster on CPU, less accurate); "
        "fp8: e4m3 weights (GPUs of compute capability 8.9+)",
    )
    model.add_argument("--quantize-lm-head", action="store_true", help="quantize the LM head too")
    model.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="ranks the model is split over, one process each (gloo on CPU, NCCL on GPU)",
    )
    model.add_argument(
        "--pipeline-parallel-size",
        type=positive_int,
        default=1,
        help="stages the decoder's layers are split into, each of --tensor-parallel-size ranks; a step's batch "
        "flows through them as micro-batches",
    )
    model.add_argument(
        "--pipeline-microbatches",
        type=positive_int,
        help="micro-batches a step flows through the stages as (default: one per stage; needs stages)",
    )
    model.add_argument(
        "--node-rank",
        type=non_negative_int,
        help="this pod's index in a replica spanning pods: 0 serves HTTP, the others serve /health and run their "
        "ranks (default: $GOODPUT_NODE_RANK, $LWS_WORKER_INDEX, the ordinal ending $GOODPUT_POD_NAME, else 0)",
    )
    model.add_argument(
        "--nnodes",
        type=positive_int,
        default=None,
        help="pods of the replica, each running tensor × pipeline / nnodes ranks "
        "(default: $GOODPUT_NNODES, $LWS_GROUP_SIZE, else 1)",
    )
    model.add_argument(
        "--leader-address",
        default=None,
        help="HOST:PORT of pod 0, where the ranks meet (torch.distributed's store; PORT+1 carries the pods' "
        "heartbeats) (default: $GOODPUT_LEADER_ADDRESS, $LWS_LEADER_ADDRESS)",
    )
    engine = p.add_argument_group("engine")
    engine.add_argument(
        "--max-num-seqs", type=positive_int, default=default("max_num_seqs"), help="most requests running at once"
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=default("max_num_batched_tokens"),
        help="token budget of one step",
    )
    engine.add_argument(
        "--block-size", type=positive_int, default=default("block_size"), help="tokens per KV cache block"
    )
    engine.add_argument(
        "--kv-cache-memory",
        type=byte_size,
        help="KV cache size on CPU, in bytes (512Mi, 2Gi); default a quarter of free memory "
        "(within the container's memory limit), at most 4Gi",
    )
    engine.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        default=default("gpu_memory_utilization"),
        help="share of GPU memory for weights, activations and KV cache",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=default("enable_prefix_caching"),
        help="share KV blocks of common prefixes",
    )
    engine.add_argument(
        "--kv-offload-bytes",
        type=byte_size,
        default=default("kv_offload_bytes"),
        help="a second KV tier on local disk of this many bytes (8Gi): blocks evicted from the KV cache "
        "are kept there and loaded back on a prefix hit instead of recomputed; 0: none",
    )
    engine.add_argument(
        "--kv-offload-dir",
        default=default("kv_offload_dir"),
        metavar="DIR",
        help="local directory of the KV offload tier's file (default: the system's temporary directory)",
    )
    engine.add_argument(
        "--max-queue",
        type=positive_int,
        default=default("max_queue"),
        help="most requests waiting; beyond it requests get 429",
    )
    engine.add_argument("--seed", type=int, default=default("seed"))
    engine.add_argument(
        "--num-threads",
        type=positive_int,
        help="CPU threads per forward pass (per rank under tensor parallelism); default: the "
        "container's CPU limit (cgroup quota), else every usable core",
    )
    engine.add_argument(
        "--step-tuning",
        default=default("step_tuning"),
        choices=["auto", "off"],
        help="on CPU with the compact modules: time decode steps of 1 to 64 sequences at start "
        "(about a second per 100 ms of step) and run each size with the threads (all or one) "
        "and matrix-product form that ran it fastest; off: all threads, F.linear",
    )
    engine.add_argument(
        "--cpu-contention",
        default=default("cpu_contention"),
        choices=["auto", "off"],
        help="on CPU with the compact modules: run steps on one thread while other processes take "
        "the cores (the kernel's run delay of the compute threads over 20%% of their time for "
        "3 s), trying the planned threads again after 2 s, then at doubling gaps up to 20 s; off: "
        "always the planned threads",
    )
    engine.add_argument(
        "--pooling",
        choices=["last", "mean"],
        help="how /v1/embeddings pools the model's final hidden states: the last token's, or the "
        "mean over every token (default: last, as for every decoder-only causal LM)",
    )
    engine.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "mistral"],
        help="the format of the model's tool calls (default: the one its chat template teaches, else hermes)",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on GPU, run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    engine.add_argument(
        "--model-impl",
        default=default("model_impl"),
        choices=["auto", "transformers"],
        help="auto: the runtime's compact modules for Llama, Mistral and Qwen2 (fused projections), "
        "transformers' modules for the rest; transformers: transformers' modules always",
    )
    engine.add_argument(
        "--compile",
        action="store_true",
        default=default("compile"),
        help="compile the compact modules' stack of decoder layers into one torch.compile graph "
        "per step of up to 256 tokens (inductor; on a GPU under the decode CUDA graphs) and warm "
        "it up at start",
    )
    adapters = p.add_argument_group("LoRA adapters")
    adapters.add_argument(
        "--enable-lora",
        action="store_true",
        default=default("enable_lora"),
        help="serve LoRA adapters in PEFT's format (on by itself with --lora-modules): a request's 'model' "
        "names the adapter",
    )
    adapters.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=list(default("lora_modules")),
        metavar="NAME=PATH",
        help="adapters loaded at start: a name and a directory with adapter_config.json and "
        "adapter_model.safetensors (file:// accepted)",
    )
    adapters.add_argument(
        "--max-loras", type=positive_int, default=default("max_loras"), help="adapter slots a step can use"
    )
    adapters.add_argument(
        "--max-cpu-loras",
        type=positive_int,
        default=default("max_cpu_loras"),
        help="adapters whose weights are held in memory, least recently used dropped first (default: 4 x --max-loras)",
    )
    adapters.add_argument(
        "--max-lora-rank", type=positive_int, default=default("max_lora_rank"), help="the largest rank served"
    )
    adapters.add_argument(
        "--pinned-loras",
        nargs="+",
        default=list(default("pinned_loras")),
        metavar="NAME",
        help="adapters of --lora-modules never dropped from memory, their slots reused last",
    )
    adapters.add_argument(
        "--lora-source",
        default=default("lora_source"),
        metavar="DIR",
        help="a directory of adapters, one per subdirectory: a request naming one not loaded yet loads it "
        "(the request waits for the load); with it LoRA is enabled",
    )
    adapters.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=default("allow_runtime_lora_updating"),
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key when set)",
    )
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-method",
        choices=["ngram", "draft"],
        help="propose tokens for the target model to verify: ngram (prompt lookup in the request's "
        "own tokens) or draft (--speculative-model); default: off",
    )
    spec.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=default("num_speculative_tokens"),
        help="tokens proposed per step and request",
    )
    spec.add_argument(
        "--speculative-model",
        help="the draft model for --speculative-method draft (a directory, .gguf or Hub id), with "
        "the target's tokenizer",
    )
    spec.add_argument(
        "--ngram-min", type=positive_int, default=default("ngram_min"), help="shortest suffix prompt lookup matches"
    )
    spec.add_argument(
        "--ngram-max", type=positive_int, default=default("ngram_max"), help="longest suffix prompt lookup matches"
    )
    spec.add_argument(
        "--speculative-max-batch",
        type=non_negative_int,
        help="speculate only while at most this many requests run (0: never); default: timed at "
        "start-up, the largest batch at which verifying the proposals costs less than it saves",
    )
    add_kv_transfer_flags(p)
    serving = p.add_argument_group("serving")
    serving.add_argument("--host", default="0.0.0.0")
    serving.add_argument("--port", type=port_number, default=8000, help="0 picks a free port")
    serving.add_argument("--slo-ttft", type=positive_seconds, help="time-to-first-token target, seconds")
    serving.add_argument("--slo-tpot", type=positive_seconds, help="time-per-output-token target, seconds")
    serving.add_argument(
        "--slo-scheduling",
        choices=["on", "off"],
        default=default("slo_scheduling"),
        help="on: waiting prompts by TTFT deadline, online prefill chunks beside decodes sized to their TPOT "
        "target (--slo-ttft/--slo-tpot, or a request's own x-goodput-slo-*-ms); off by default: measured on "
        "open-loop traffic it cost TTFT and goodput (bench/README.md, SLO capacity)",
    )
    serving.add_argument(
        "--batch-cap",
        choices=["auto", "off"],
        default=default("batch_cap"),
        help="cap the batch (priority above 0) sequences that step beside online ones so a step, "
        "timed as it runs, stays within --slo-tpot × (1 − --batch-cap-margin); the others "
        "pause until the online ones leave; auto: on when --slo-tpot is set",
    )
    serving.add_argument(
        "--batch-cap-margin",
        type=margin_fraction,
        default=default("batch_cap_margin"),
        help="share of --slo-tpot the batch cap keeps free (steps that admit an online request run longer)",
    )
    serving.add_argument(
        "--admission",
        choices=["auto", "on", "off"],
        default="auto",
        help="refuse with 429 and Retry-After, at once, a request whose predicted time to first "
        "token (from the measured prefill and decode rates, the queue ahead and the free KV "
        "cache) exceeds --slo-ttft, or that would take the running decodes' time per output token "
        "past --slo-tpot (a request's own targets, from its x-goodput-slo-ttft-ms and x-goodput-slo-tpot-ms "
        "headers, before these); auto: on, for the requests carrying their own targets where neither is set",
    )
    serving.add_argument(
        "--admission-margin",
        type=margin_fraction,
        default=0.1,
        help="safety margin of admission: refuse when the predicted TTFT exceeds --slo-ttft × (1 − margin)",
    )
    serving.add_argument(
        "--shutdown-grace",
        type=seconds,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (after --shutdown-delay)",
    )
    serving.add_argument(
        "--shutdown-delay",
        type=seconds,
        default=0.0,
        help="seconds after SIGTERM during which /health is 503 but new requests are still "
        "served, each with Connection: close, while Kubernetes removes the pod from its "
        "endpoints; then new requests get 503 and --shutdown-grace begins",
    )
    serving.add_argument(
        "--termination-message-path",
        default=TERMINATION_MESSAGE_PATH,
        help="file that gets a one-line reason when the runtime cannot start; written only "
        "if it exists, or if its directory exists and is not /dev",
    )
    serving.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="ask every request but /health and /metrics for 'Authorization: Bearer KEY' "
        "(repeatable; default: the comma-separated keys in $GOODPUT_API_KEY, if set). "
        "The environment keeps keys out of the process list",
    )
    serving.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def add_kv_transfer_flags(p: argparse.ArgumentParser) -> None:
    """Disaggregated prefill and decode: the KV hand-off between runtimes (engine/kv_transfer/)."""
    kv = p.add_argument_group("KV hand-off (disaggregated prefill and decode)")
    kv.add_argument(
        "--kv-transfer-role",
        default=default("kv_transfer_role"),
        choices=["none", "prefill", "decode", "both"],
        help="prefill: requests with kv_transfer_params do_remote_decode keep their prompt's KV blocks under a "
        "lease for a decode runtime to pull; decode: requests carrying a prefill runtime's hand-off pull those "
        "blocks; both: either; none: a request with kv_transfer_params is refused (400)",
    )
    kv.add_argument(
        "--kv-transfer-transport",
        default=default("kv_transfer_transport"),
        choices=["tcp", "local"],
        help="tcp: between processes; local: between runtimes in one process (tests)",
    )
    kv.add_argument(
        "--kv-transfer-port",
        type=port_number,
        default=default("kv_transfer_port"),
        help="the tcp transport's listen port (0: a free one, logged)",
    )
    kv.add_argument(
        "--kv-transfer-host",
        help="the address advertised to decode runtimes (default: $POD_IP, else the host's address)",
    )
    kv.add_argument(
        "--kv-lease-seconds",
        type=positive_seconds,
        default=default("kv_lease_seconds"),
        help="a prefill runtime frees a finished prompt's blocks after this long unless released sooner",
    )
    kv.add_argument(
        "--kv-failure-policy",
        default=default("kv_failure_policy"),
        choices=["recompute", "fail"],
        help="on a failed hand-off, compute the prompt here (recompute) or answer 503 kv_transfer_failed (fail)",
    )
    kv.add_argument(
        "--kv-transfer-timeout",
        type=positive_seconds,
        default=default("kv_transfer_timeout"),
        help="seconds: the bound on any one hand-off",
    )
