"""What one scheduling pass decides: the sequences that run this step, how many tokens each, and the
step's counts; and which requests are batch work (priority above 0)."""

from __future__ import annotations

from dataclasses import dataclass, field

from goodput_runtime.engine.sequence import Sequence


def is_batch(seq: Sequence) -> bool:
    return seq.params.priority > 0


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # computed this step, from seq.num_computed_tokens on
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # to make before the step
    # positions [start, stop) of this step whose logits give prompt logprobs, each predicting the
    # prompt token after it; empty unless the request asked for them and they are not yet reported
    prompt_logprobs: range = range(0)
    draft: list[int] = field(default_factory=list)  # proposed tokens verified after the last one (in num_tokens)
    lora_slot: int = 0  # the LoRA slot its rows use; 0: the base model

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so its next token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens - len(self.draft) == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_preempted: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    speculative: bool = False  # the switch allowed speculation this step (and proposals for the next)
    batch_cap: int | None = None  # batch sequences allowed beside the online ones this step; None: not capped
    batch_paused: int = 0  # running batch sequences the cap kept out of this step
    num_decodes: int = 0  # sequences decoding one token (with or without proposals), counted at scheduling
    num_online_decodes: int = 0  # those of online requests
    num_prompt_tokens: int = 0  # every other token computed: prefills, recomputation, proposals verified
    offload_hit_tokens: int = 0  # of prefix_hit_tokens, those loaded from the KV offload tier
    # KV offload (engine/kv_offload.py): (block id, hash) to copy out, then (block id, payload) to copy
    # in, before this step's forward pass
    kv_saves: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, bytearray]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_batch(self) -> int:
        return sum(1 for s in self.scheduled if is_batch(s.seq))
