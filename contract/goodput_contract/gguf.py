"""GGUF files: the header (key/value metadata and tensor table), and the config.json it implies.

A GGUF file (llama.cpp's format) starts with ``GGUF``, a version, the tensor count and the
metadata count, then the metadata key/value pairs, then one entry per tensor (name, shape,
GGML type, offset); the tensor data follows. This module reads that header in pure Python,
without reading the tensor data, so the operator can size a model from a GGUF file, or from
its first bytes (a ranged HTTP read), and the runtime can name the quantization types in a
file before loading it.

``hf_config`` turns the metadata into the ``config.json`` fields the capacity planner and
the architecture check read, the way transformers' GGUF loader names them.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"GGUF"
SUFFIX = ".gguf"
LONG_ARRAY = 64  # arrays longer than this keep only their length (the tokenizer's vocabulary, merges)

# GGML tensor types by id (ggml.h), as llama.cpp and the gguf package name them
GGML_TYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
    40: "NVFP4",
    41: "Q1_0",
}

# GGUF architecture -> (transformers model_type, config.json architecture)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "falcon": ("falcon", "FalconForCausalLM"),
    "stablelm": ("stablelm", "StableLmForCausalLM"),
    "starcoder2": ("starcoder2", "Starcoder2ForCausalLM"),
    "gpt2": ("gpt2", "GPT2LMHeadModel"),
    "bloom": ("bloom", "BloomForCausalLM"),
}

# value types of the metadata
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """Not a GGUF file, or one whose header cannot be read (truncated, an unknown value type)."""


@dataclass(frozen=True)
class LongArray:
    """An array in the metadata that is only counted, not kept."""

    item_type: int
    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_id: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.type_id, f"type {self.type_id}")


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...] = field(default=())

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_types(self) -> dict[str, int]:
        """How many tensors of each GGML type the file holds, by type name."""
        counts: dict[str, int] = {}
        for tensor in self.tensors:
            counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
        return counts


class _Stream:
    def __init__(self, raw: BinaryIO, where: str) -> None:
        self.raw = raw
        self.where = where

    def read(self, n: int) -> bytes:
        data = self.raw.read(n)
        if len(data) != n:
            raise GGUFError(f"{self.where}: the GGUF header ends early (truncated at byte {self.raw.tell()})")
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.read(self.unpack("<Q")).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.read(self.unpack("<Q"))

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if count <= LONG_ARRAY:
                return [self.value(item_type) for _ in range(count)]
            if item_type == _STRING:
                for _ in range(count):
                    self.skip_string()
            elif item_type in _SCALARS:
                self.read(count * struct.calcsize(_SCALARS[item_type]))
            else:
                for _ in range(count):
                    self.value(item_type)
            return LongArray(item_type, count)
        raise GGUFError(f"{self.where}: unknown GGUF metadata value type {value_type}")


def read_header(source: str | Path | bytes | BinaryIO, where: str | None = None) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file (a path, its first bytes, or an open binary file).

    Raises GGUFError when it is not GGUF, or when the bytes end before the header does.
    """
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:
            return read_header(io.BufferedReader(f, 1 << 20), where or str(source))
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    stream = _Stream(source, where or "GGUF data")
    magic = stream.raw.read(4)
    if magic != MAGIC:
        raise GGUFError(f"{stream.where} is not a GGUF file (it starts with {magic[:4]!r}, not {MAGIC!r})")
    version = stream.unpack("<I")
    if version not in (2, 3):
        raise GGUFError(
            f"{stream.where}: GGUF version {version} is not supported (2 and 3 are; "
            "a big-endian file also reads as an unknown version)"
        )
    num_tensors, num_kv = stream.unpack("<Q"), stream.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = stream.string()
        metadata[key] = stream.value(stream.unpack("<I"))
    tensors = []
    for _ in range(num_tensors):
        name = stream.string()
        dims = tuple(stream.unpack("<Q") for _ in range(stream.unpack("<I")))
        type_id = stream.unpack("<I")
        stream.unpack("<Q")  # offset of the data
        tensors.append(TensorInfo(name, dims, type_id))
    return GGUFHeader(version, metadata, tuple(tensors))


def hf_config(header: GGUFHeader) -> dict[str, Any]:
    """The config.json fields a GGUF file implies (what transformers' GGUF loader builds).

    An architecture without a mapping gets its GGUF name in ``architectures``, so the
    architecture check names it; a missing shape key is simply left out (the caller names it).
    """
    meta = header.metadata
    arch = header.architecture
    model_type, architecture = ARCHITECTURES.get(arch, (arch, f"{arch or 'unknown'} (GGUF architecture)"))
    name = str(meta.get("general.name", ""))
    if arch == "llama" and "mistral" in name.lower():  # llama.cpp writes Mistral models as llama
        model_type, architecture = ARCHITECTURES["mistral"]
    config: dict[str, Any] = {"architectures": [architecture], "model_type": model_type}
    keys = {
        "hidden_size": "embedding_length",
        "num_hidden_layers": "block_count",
        "intermediate_size": "feed_forward_length",
        "num_attention_heads": "attention.head_count",
        "num_key_value_heads": "attention.head_count_kv",
        "max_position_embeddings": "context_length",
        "rms_norm_eps": "attention.layer_norm_rms_epsilon",
        "rope_theta": "rope.freq_base",
        "head_dim": "attention.key_length",
        "vocab_size": "vocab_size",
        "sliding_window": "attention.sliding_window",
        "num_local_experts": "expert_count",
    }
    for hf_key, gguf_key in keys.items():
        value = meta.get(f"{arch}.{gguf_key}")
        if isinstance(value, list):  # per-layer values: the sizing reads the largest
            value = max(value) if value else None
        if value is not None:
            config[hf_key] = value
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if "head_dim" not in config and model_type in ("llama", "mistral") and rope_dims:  # as transformers reads it
        config["head_dim"] = rope_dims
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta:
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    names = {t.name for t in header.tensors}
    if names:
        config["tie_word_embeddings"] = "output.weight" not in names
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    return config


def unsupported_types(header: GGUFHeader, supported: Iterable[str]) -> dict[str, list[str]]:
    """Tensors whose GGML type is not in ``supported``: type name -> tensor names."""
    allowed = set(supported)
    found: dict[str, list[str]] = {}
    for tensor in header.tensors:
        if tensor.type_name not in allowed:
            found.setdefault(tensor.type_name, []).append(tensor.name)
    return found


def quantization_problem(header: GGUFHeader, supported: Iterable[str], where: str) -> str | None:
    """Why the tensors of a GGUF file cannot be loaded (types outside ``supported``), or None."""
    bad = unsupported_types(header, supported)
    if not bad:
        return None
    described = "; ".join(f"{kind} ({len(names)} tensors, e.g. {names[0]})" for kind, names in sorted(bad.items()))
    return (
        f"{where} holds tensors of unsupported GGUF quantization type {described}; "
        f"supported: {', '.join(sorted(set(supported)))}"
    )
