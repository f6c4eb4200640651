"""The runtime's command-line flags, and which InferenceService field each one carries.

The operator builds a runtime's command line from the CR with ``to_args``; the runtime's
parser (``python -m goodput_runtime --help``) defines the same flags. A field named here is
one the operator passes through unchanged in meaning, converted only to text.
"""

from __future__ import annotations

from collections.abc import Mapping

MODEL = "--model"
SERVED_MODEL_NAME = "--served-model-name"
REVISION = "--revision"
DTYPE = "--dtype"
DEVICE = "--device"
MAX_MODEL_LEN = "--max-model-len"
QUANTIZATION = "--quantization"
TENSOR_PARALLEL_SIZE = "--tensor-parallel-size"
PIPELINE_PARALLEL_SIZE = "--pipeline-parallel-size"
MAX_NUM_SEQS = "--max-num-seqs"
MAX_NUM_BATCHED_TOKENS = "--max-num-batched-tokens"
GPU_MEMORY_UTILIZATION = "--gpu-memory-utilization"
ENABLE_PREFIX_CACHING = "--enable-prefix-caching"  # a boolean: --no-enable-prefix-caching turns it off
MAX_QUEUE = "--max-queue"
SLO_TTFT = "--slo-ttft"  # seconds
SPECULATIVE_METHOD = "--speculative-method"
NUM_SPECULATIVE_TOKENS = "--num-speculative-tokens"
SPECULATIVE_MODEL = "--speculative-model"  # the draft model: a Hub id or a path, like --model
SLO_TPOT = "--slo-tpot"  # seconds
# LoRA adapters (spec.model.lora): the adapters as NAME=PATH, each where the pod reads it
ENABLE_LORA = "--enable-lora"
LORA_MODULES = "--lora-modules"  # spec.model.lora.adapters
MAX_LORAS = "--max-loras"  # spec.model.lora.maxAdapters
MAX_LORA_RANK = "--max-lora-rank"  # spec.model.lora.maxRank
MAX_CPU_LORAS = "--max-cpu-loras"  # spec.model.lora.maxCpuAdapters
ALLOW_RUNTIME_LORA_UPDATING = "--allow-runtime-lora-updating"  # spec.model.lora.runtimeUpdates (goodput)
# the KV offload tier (spec.engine.kvOffload): its bound in bytes, and the directory of the volume it lives in
KV_OFFLOAD_BYTES = "--kv-offload-bytes"
KV_OFFLOAD_DIR = "--kv-offload-dir"
# set by the operator, not from a CR field
HOST = "--host"
PORT = "--port"
SHUTDOWN_DELAY = "--shutdown-delay"  # seconds
SHUTDOWN_GRACE = "--shutdown-grace"  # seconds
TERMINATION_MESSAGE_PATH = "--termination-message-path"
# a replica spanning pods: set by the operator per pod
NODE_RANK = "--node-rank"
NNODES = "--nnodes"
LEADER_ADDRESS = "--leader-address"

# CR field (its path under spec) -> the runtime flag that carries its value
CR_FIELD_FLAGS: dict[str, str] = {
    "model.source": MODEL,  # the Hub id, or the path the source is mounted at
    "model.servedName": SERVED_MODEL_NAME,
    "model.revision": REVISION,  # hf:// sources only
    "model.dtype": DTYPE,
    "model.maxModelLen": MAX_MODEL_LEN,
    "model.quantization": QUANTIZATION,
    "resources.gpu": DEVICE,  # cuda when the replica has GPUs, else cpu
    "parallelism.tensor": TENSOR_PARALLEL_SIZE,
    "engine.maxNumSeqs": MAX_NUM_SEQS,
    "engine.maxBatchedTokens": MAX_NUM_BATCHED_TOKENS,
    "engine.gpuMemoryUtilization": GPU_MEMORY_UTILIZATION,
    "engine.prefixCaching": ENABLE_PREFIX_CACHING,
    "engine.maxQueue": MAX_QUEUE,
    "engine.speculative.method": SPECULATIVE_METHOD,
    "engine.speculative.tokens": NUM_SPECULATIVE_TOKENS,
    "engine.speculative.draftModel": SPECULATIVE_MODEL,  # the Hub id, or the path the source is mounted at
    "slo.ttft": SLO_TTFT,
    "slo.tpot": SLO_TPOT,
}
BOOLEAN_FLAGS = frozenset({ENABLE_PREFIX_CACHING})


def negated(flag: str) -> str:
    """``--enable-x`` -> ``--no-enable-x``: how a boolean flag is turned off."""
    return "--no-" + flag.removeprefix("--")


def flag_args(flag: str, value: object) -> list[str]:
    """One flag with its value: nothing for None; a boolean flag alone or negated; floats in their
    shortest form (0.5, not 0.500000)."""
    if value is None:
        return []
    if flag in BOOLEAN_FLAGS:
        if not isinstance(value, bool):
            raise TypeError(f"{flag} takes true or false, not {value!r}")
        return [flag if value else negated(flag)]
    if isinstance(value, bool):
        raise TypeError(f"{flag} takes a value, not {value!r}")
    return [flag, f"{value:.12g}" if isinstance(value, float) else str(value)]


def to_args(fields: Mapping[str, object]) -> list[str]:
    """Runtime arguments for CR field values (keys of ``CR_FIELD_FLAGS``), in the given order."""
    args: list[str] = []
    for field, value in fields.items():
        if field not in CR_FIELD_FLAGS:
            raise KeyError(f"{field} has no runtime flag; known fields: {', '.join(CR_FIELD_FLAGS)}")
        args += flag_args(CR_FIELD_FLAGS[field], value)
    return args
