"""Tensor parallelism: which numbers of ranks can split a model.

The runtime splits attention heads, KV heads and the MLP's intermediate columns evenly over
its ranks (column parallel q/k/v and gate/up, row parallel o and down), and shards the KV
cache by KV heads. It neither replicates KV heads nor pads a shard, so the tensor-parallel
size must divide each of the three numbers. The operator refuses a spec by this rule before
any pod starts; the runtime refuses a command line by it before any rank starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder that tensor parallelism splits (from config.json)."""

    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads, or num_attention_heads where absent
    intermediate_size: int  # the MLP's intermediate_size

    def split(self) -> tuple[tuple[str, int], ...]:
        """Each quantity that is split over ranks, with its name as messages spell it."""
        return (
            ("attention heads", self.num_heads),
            ("KV heads", self.num_kv_heads),
            ("MLP intermediate size", self.intermediate_size),
        )


def valid_tensor_sizes(shape: ModelShape) -> list[int]:
    """Every tensor-parallel size that divides heads, KV heads and intermediate size, ascending."""
    common = math.gcd(shape.num_heads, shape.num_kv_heads, shape.intermediate_size)
    return [n for n in range(1, common + 1) if common % n == 0]


def _one_of(sizes: list[int]) -> str:
    words = [str(n) for n in sizes]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def tensor_parallel_problem(shape: ModelShape, tensor: int, field: str) -> str | None:
    """Why ``tensor`` ranks cannot split this model, naming ``field`` (the setting that holds
    ``tensor``: a CR field or a runtime flag); None when they can."""
    if tensor < 1:
        return f"{field} {tensor} must be at least 1"
    problems = [f"{what} ({n}) is not divisible by {field} {tensor}" for what, n in shape.split() if n % tensor]
    if not problems:
        return None
    return (
        f"{'; '.join(problems)}: tensor parallelism splits the model's {shape.num_heads} attention heads, "
        f"{shape.num_kv_heads} KV heads and MLP intermediate size {shape.intermediate_size} evenly over "
        f"its ranks, so {field} must be {_one_of(valid_tensor_sizes(shape))}"
    )


def kv_heads_per_rank(shape: ModelShape, tensor: int) -> int:
    """KV heads each rank holds in its cache; ValueError when ``tensor`` does not divide them."""
    if tensor < 1 or shape.num_kv_heads % tensor:
        raise ValueError(f"{tensor} ranks cannot split {shape.num_kv_heads} KV heads evenly")
    return shape.num_kv_heads // tensor


def pipeline_problem(num_layers: int, pipeline: int, field: str) -> str | None:
    """Why ``pipeline`` stages cannot split a model of ``num_layers`` decoder layers, naming
    ``field``; None when they can. Each stage runs a contiguous run of at least one layer."""
    if pipeline < 1:
        return f"{field} {pipeline} must be at least 1"
    if num_layers < pipeline:
        return f"{field} {pipeline} exceeds the model's {num_layers} layers: each pipeline stage needs at least one"
    return None


def pods_per_replica(gpus: int, gpus_per_node: int | None) -> int:
    """Pods one replica of ``gpus`` GPUs (tensor × pipeline) spans: one when it fits a node (or no
    node size is given), else one pod per node of ``gpus_per_node`` GPUs; ValueError when the
    GPUs cannot be spread evenly over whole nodes."""
    if gpus_per_node is None or gpus <= gpus_per_node:
        return 1
    if gpus % gpus_per_node:
        raise ValueError(f"{gpus} GPUs cannot be spread evenly over nodes of {gpus_per_node}")
    return gpus // gpus_per_node
