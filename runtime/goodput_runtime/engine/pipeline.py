"""Pipeline parallelism: the decoder's layers split into stages, one stage per group of ranks.

Ranks are laid out stage-major: global rank r is tensor rank ``r % tensor`` of stage
``r // tensor``, so a stage's tensor-parallel ranks are neighbours (one node, where the fast
links are) and stages cross nodes. Stage s keeps layers ``stage_layers(...)`` only, with its
KV cache for them alone. Every rank receives each step's plan from rank 0 (a broadcast over
the whole group), then runs its part of the micro-batched schedule (engine/pipeline_schedule.py):

- the step's batch is split into micro-batches (``--pipeline-microbatches``, default one per stage);
- stage 0 embeds each micro-batch's tokens and runs its layers, sending each on as it is done;
- each later stage receives a micro-batch's hidden states (``[1, tokens, hidden]``, one
  point-to-point send between ranks of the same tensor rank), runs its layers and sends them on,
  while the stage before it already runs the next micro-batch;
- the last stage applies the final norm and sends each micro-batch's hidden states back to rank 0,
  which applies the LM head to each as it arrives, then samples the step.

So in steady decode more than one stage works at a time; each stage still idles
``(P - 1) / (M + P - 1)`` of a step (the fill and drain of P stages and M micro-batches).
Pipeline parallelism is here to fit a model larger than one node's memory; micro-batches make it
cost less, not a step faster than one node would run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    (renumbered from 0, so its KV cache holds them alone) and the final norm on the last stage only.
    The schedule (engine/pipeline_schedule.py) feeds it and passes its hidden states on."""
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


def microbatch_problem(microbatches: int | None, pipeline: int) -> str | None:
    """Why ``--pipeline-microbatches`` cannot be used with this many stages, or None."""
    if microbatches is None:
        return None
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        return f"--pipeline-microbatches {microbatches!r}: expected an integer of at least 1"
    if microbatches > 1 and pipeline == 1:
        return (
            f"--pipeline-microbatches {microbatches} needs --pipeline-parallel-size above 1: "
            "micro-batches split a step between pipeline stages"
        )
    return None


def microbatches(configured: int | None, pipeline: int) -> int:
    """Micro-batches a step is split into: as configured, else one per stage."""
    return configured if configured is not None else pipeline
