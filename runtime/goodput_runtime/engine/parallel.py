"""Tensor parallelism: one process per rank, the model sharded by heads and MLP columns.

With pipeline parallelism too (engine/pipeline.py), each stage's ranks form their own
tensor-parallel group; with several pods (engine/rendezvous.py), each pod starts its own ranks
and all of them meet at the leader's address.

The runtime starts its own ranks: the serving process is rank 0 and drives every step;
followers receive each step's plan, run the same forward pass on their shard and take part
in the all-reduces. Attention heads and the MLP's gate/up rows are split across ranks
(column parallel), the output and down projections by their input columns (row parallel),
so each decoder block needs one all-reduce after attention and one after the MLP. The KV
cache is split by KV heads; only rank 0 computes logits and samples. A rank that dies takes
the server down with a non-zero exit, so Kubernetes restarts the pod instead of it hanging.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from goodput_contract import flags
from goodput_contract.parallel import ModelShape, pipeline_problem, tensor_parallel_problem
from goodput_runtime.engine import rendezvous

log = logging.getLogger(__name__)

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
# followers wait for the next step for as long as the server idles
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)


class TensorParallelError(ValueError):
    """The model or the machine cannot be split this many ways."""


def model_shape(model_config) -> ModelShape:
    """What tensor parallelism splits, from a transformers config."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    return ModelShape(heads, kv_heads, model_config.intermediate_size)


def validate(model_config, tensor: int, device: torch.device, pipeline: int = 1, ranks_here: int | None = None) -> None:
    """Refuse a split the model's shape does not allow (the contract's rules), or more GPUs than are
    visible for this pod's ranks (``ranks_here``, all of them where None)."""
    problem = tensor_parallel_problem(model_shape(model_config), tensor, flags.TENSOR_PARALLEL_SIZE) or (
        pipeline_problem(model_config.num_hidden_layers, pipeline, flags.PIPELINE_PARALLEL_SIZE)
    )
    if problem:
        raise TensorParallelError(problem)
    here = tensor * pipeline if ranks_here is None else ranks_here
    if device.type == "cuda" and here > torch.cuda.device_count():
        raise TensorParallelError(f"{here} ranks in this pod need {here} GPUs; {torch.cuda.device_count()} are visible")


def _shard(linear: nn.Linear, dim: int, rank: int, world: int) -> None:
    weight = linear.weight.detach().chunk(world, dim=dim)[rank].contiguous()
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.out_features, linear.in_features = weight.shape
    if linear.bias is not None:
        if dim == 0:
            linear.bias = nn.Parameter(linear.bias.detach().chunk(world)[rank].contiguous(), requires_grad=False)
        elif rank != 0:  # a row-parallel bias is added once, after the sum
            linear.register_parameter("bias", None)


def _all_reduce(group: Any):
    def hook(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=group)
        return output

    return hook


def shard_model(model: Any, rank: int, world: int, group: Any = None) -> None:
    """Split every decoder layer's projections for this rank (its rank within its tensor-parallel
    ``group``, the whole world where None) and add the all-reduces, in place."""
    for layer in model.model.layers:
        for block in (layer.self_attn, layer.mlp):
            for name, child in block.named_children():
                if name in COLUMN_PARALLEL:
                    _shard(child, 0, rank, world)
                elif name in ROW_PARALLEL:
                    _shard(child, 1, rank, world)
                    child.register_forward_hook(_all_reduce(group))


def tensor_groups(tensor: int, pipeline: int, stage: int) -> Any:
    """This stage's tensor-parallel process group; every rank creates every stage's, in order."""
    if pipeline == 1:
        return None
    groups = [dist.new_group(list(range(s * tensor, (s + 1) * tensor))) for s in range(pipeline)]
    return groups[stage]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, init_method: str, device: torch.device) -> None:
    """Join the group at ``init_method`` (``tcp://host:port``, the leader's store)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """A rank's device: its GPU by its index among this pod's ranks."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def broadcast(obj=None):
    """Rank 0 sends obj to every rank; each rank returns what rank 0 sent."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Followers:
    """This pod's other rank processes (``ranks``, global numbers), watched for as long as it runs."""

    def __init__(self, ranks: list[int], world: int, init_method: str, model_dir: Path, config_json: str) -> None:
        self.ranks = ranks
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "goodput_runtime.engine.tp_worker",
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(world),
                    "--local-rank",
                    str(local),
                    "--init-method",
                    init_method,
                    "--model-dir",
                    str(model_dir),
                    "--config",
                    config_json,
                ]
            )
            for local, rank in enumerate(ranks, start=1)
        ]
        self.stopping = False
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopping:
            for rank, proc in zip(self.ranks, self.procs, strict=True):
                code = proc.poll()
                if code is not None and not self.stopping:
                    log.error("Tensor-parallel rank %d exited with code %s; stopping the server", rank, code)
                    logging.shutdown()
                    os._exit(1)
            time.sleep(0.2)

    def stop(self, tell: bool = True) -> None:
        """Tell the followers to finish (rank 0 alone tells the whole group), then make sure they have."""
        self.stopping = True
        rendezvous.stop_watching()
        if tell:
            try:
                broadcast(None)
            except Exception:  # a follower already gone: nothing left to tell
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
