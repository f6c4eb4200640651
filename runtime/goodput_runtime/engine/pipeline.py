"""Pipeline parallelism: the decoder's layers split into stages, one stage per group of ranks.

Ranks are laid out stage-major: global rank r is tensor rank ``r % tensor`` of stage
``r // tensor``, so a stage's tensor-parallel ranks are neighbours (one node, where the fast
links are) and stages cross nodes. Stage s keeps layers ``stage_layers(...)`` only, with its
KV cache for them alone. Every rank receives each step's plan from rank 0 (a broadcast over
the whole group), then:

- stage 0 embeds the step's tokens and runs its layers;
- each later stage receives the previous stage's hidden states (``[1, tokens, hidden]``, one
  point-to-point send between ranks of the same tensor rank) and runs its layers;
- the last stage applies the final norm and sends the hidden states back to rank 0, which
  applies the LM head and samples.

The schedule is the simplest one: a step passes through the stages one after another, so in
steady decode one stage works at a time and each stage idles ``(P - 1) / P`` of a step (the
bubble). Splitting steps into micro-batches in flight at once would shrink it; the runtime does
not do that yet. Pipeline parallelism is here to fit a model larger than one node's memory, not
to make a step faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Topology:
    """Where one rank sits: ``tensor`` ranks per stage, ``pipeline`` stages."""

    rank: int
    tensor: int = 1
    pipeline: int = 1

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline

    @property
    def stage(self) -> int:
        return self.rank // self.tensor

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tensor, (stage + 1) * self.tensor))

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pipeline - 1


def stage_layers(num_layers: int, pipeline: int, stage: int) -> range:
    """The layers stage ``stage`` runs: contiguous, as even as can be, earlier stages one more."""
    if pipeline < 1 or num_layers < pipeline:
        raise ValueError(f"{num_layers} layers cannot be split into {pipeline} pipeline stages")
    base, extra = divmod(num_layers, pipeline)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def cut_model(model: Any, topology: Topology) -> None:
    """Keep this rank's stage of `model` (a transformers causal LM), in place: its layers alone
    (renumbered from 0, so its KV cache holds them alone), the final norm on the last stage only,
    and a forward that receives and sends the hidden states between stages."""
    if topology.pipeline == 1:
        return
    inner = model.model
    layers = stage_layers(len(inner.layers), topology.pipeline, topology.stage)
    kept = [inner.layers[i] for i in layers]
    for local, layer in enumerate(kept):
        layer.self_attn.layer_idx = local
    inner.layers = nn.ModuleList(kept)
    inner.config.num_hidden_layers = len(kept)  # what the model's forward loops over
    if not topology.last:
        inner.norm = nn.Identity()
    inner.forward = MethodType(_staged(type(inner).forward, topology), inner)


def _staged(forward, topology: Topology):
    previous = topology.rank - topology.tensor
    following = topology.rank + topology.tensor
    last_stage_head = (topology.pipeline - 1) * topology.tensor  # tensor rank 0 of the last stage

    def staged_forward(self, input_ids=None, position_ids=None, inputs_embeds=None, **kwargs):
        tokens = position_ids.shape[-1]
        if not topology.first:
            embed = self.embed_tokens.weight
            inputs_embeds = torch.empty(1, tokens, embed.shape[1], dtype=embed.dtype, device=embed.device)
            dist.recv(inputs_embeds, previous)
            input_ids = None
        out = forward(self, input_ids=input_ids, position_ids=position_ids, inputs_embeds=inputs_embeds, **kwargs)
        hidden = out.last_hidden_state.contiguous()
        if not topology.last:
            dist.send(hidden, following)
        if topology.rank == last_stage_head:
            dist.send(hidden, 0)
        elif topology.rank == 0:
            dist.recv(hidden, last_stage_head)  # the final hidden states, after the last stage's norm
            out.last_hidden_state = hidden
        return out

    return staged_forward
