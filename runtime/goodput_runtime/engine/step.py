"""What one step computes, in plain values: the KV cache's shape per token, each sequence's share of a
step (StepItem, made from the scheduler's output by plan_step), and what the step returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from goodput_runtime.engine.outputs import TokenLogprob
from goodput_runtime.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    kv_heads: int  # on this rank: the model's KV heads divided by the tensor-parallel size
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model_config, dtype: torch.dtype, tensor_parallel: int = 1) -> KVLayout:
        heads = model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        return cls(model_config.num_hidden_layers, kv_heads // tensor_parallel, head_dim, dtype)

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()


@dataclass(slots=True)
class StepItem:
    """One sequence's share of a step, in plain Python so it can be sent to other ranks."""

    token_ids: list[int]  # the tokens computed this step
    start: int  # tokens already in the cache
    block_table: list[int]
    samples: bool
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination), before the step
    prompt_first: int = 0  # rows [prompt_first, prompt_first + prompt_count) of this item give prompt logprobs
    prompt_count: int = 0
    pool: str | None = None  # an embedding request's pooling mode: its rows' hidden states are pooled
    pool_ends: bool = False  # this step completes its prompt: the pooled vector is ready
    num_draft: int = 0  # the last num_draft tokens are proposals: every row from the last real token on samples
    lora_slot: int = 0  # the LoRA slot its rows use (layers/lora.py); 0: the base model

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)

    def kept_rows(self, last_row: int) -> list[int]:
        """Rows of the flat step whose logits this item needs: its prompt-logprob rows, then its
        sampling row. last_row is the flat row of its last token."""
        first = last_row - len(self.token_ids) + 1 + self.prompt_first
        rows = list(range(first, first + self.prompt_count))
        if self.samples:
            rows.extend(range(last_row - self.num_draft, last_row + 1))
        return rows


@dataclass(slots=True)
class StepResult:
    """What a step produced, by the position of each sequence in the scheduler's output."""

    tokens: list[int | None]  # the sampled token per sequence; None mid-prefill
    fork_tokens: dict[int, list[int]] = field(default_factory=dict)  # first tokens of the choices forking there
    logprobs: dict[tuple[str, int], TokenLogprob] = field(default_factory=dict)  # by (request id, choice)
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # of this step's prompt rows
    embeddings: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # of completed embedding requests
    accepted: dict[int, list[int]] = field(default_factory=dict)  # proposed tokens kept, before the sampled one
    verified: list[tuple[int, int]] = field(default_factory=list)  # (tokens proposed, accepted) per verification
    proposals: dict[int, list[int]] = field(default_factory=dict)  # tokens proposed for the next step

    @property
    def num_sampled(self) -> int:
        return (
            sum(t is not None for t in self.tokens)
            + sum(len(t) for t in self.fork_tokens.values())
            + sum(len(t) for t in self.accepted.values())
        )


def plan_step(out: SchedulerOutput) -> tuple[list[int], list[StepItem]]:
    """The step's items, decodes first and longest context first, so similar lengths share a padded
    attention batch; with the scheduled position of each."""
    scheduled = out.scheduled
    # by the context the step attends to (a one-token prefill chunk is a decode of a short context)
    order = sorted(
        range(len(scheduled)),
        key=lambda i: (scheduled[i].num_tokens != 1, -(scheduled[i].start + scheduled[i].num_tokens)),
    )
    items = []
    for i in order:
        s = scheduled[i]
        tokens = s.seq.token_ids[s.start : s.start + s.num_tokens - len(s.draft)] + s.draft
        prompt = s.prompt_logprobs
        pool = s.seq.pooling.mode if s.seq.pooling is not None else None
        items.append(
            StepItem(
                tokens,
                s.start,
                list(s.seq.block_table),
                s.samples and pool is None,
                s.block_copies,
                prompt.start - s.start if prompt else 0,
                len(prompt),
                pool,
                s.samples,
                len(s.draft),
                s.lora_slot,
            )
        )
    return order, items
