"""Request state as the scheduler and block manager see it: plain Python, no tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from goodput_runtime.request_times import RequestTimes
from goodput_runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from goodput_runtime.structured.grammar import Grammar


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """An embedding request: its prompt is prefilled like any other and its final hidden states
    (after the model's last norm) are pooled instead of sampled; it generates nothing."""

    mode: str  # last: the last prompt position's hidden state; mean: the average over every position
    normalize: bool = True  # L2-normalize the pooled vector


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # a decode runtime's request whose prompt blocks are being pulled from a prefill runtime (kv_transfer/):
    # parked outside the queue, holding the blocks they land in, until they have or the hand-off failed
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by the output so far
    num_prompt_tokens: int
    params: SamplingParams
    times: RequestTimes
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # one per full, computed block
    num_computed_tokens: int = 0  # tokens whose keys and values are in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    index: int = 0  # which of the request's choices this is
    # the request's other choices, until this sequence's prefill ends and they fork from it
    forks: list[Sequence] = field(default_factory=list)
    # (source, destination) blocks to copy before this sequence's next step writes (copy-on-write)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # prompt positions whose next-token logprobs were computed (prompt logprobs are reported once)
    num_prompt_logprob_positions: int = 0
    pooling: PoolingParams | None = None  # an embedding request: pooled at the prompt's end, never sampled
    # this choice's grammar matcher (structured/grammar.py), advanced with each token it accepts; a
    # preempted sequence keeps its output tokens for the recompute, so the matcher keeps its state too
    grammar: Grammar | None = None
    # the prefix cache's salt beyond the model's: the LoRA adapter's name and weights' digest ("" for the
    # base model), so that blocks are shared only between sequences of the same adapter
    cache_salt: str = ""
    # a prefill runtime's request (kv_transfer_params do_remote_decode): at a normal finish its full prompt
    # blocks stay held under a lease (kv_transfer/leases.py) instead of being freed, and kv_handoff holds
    # what a decode runtime pulls them by
    lease_kv: bool = False
    kv_handoff: dict | None = None

    @classmethod
    def new(
        cls,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        arrival: float,
        times: RequestTimes | None = None,
        index: int = 0,
    ) -> Sequence:
        times = times or RequestTimes(
            arrival=arrival,
            num_prompt_tokens=len(prompt),
            priority=params.priority,
            lora=params.lora,
            slo_ttft=params.slo_ttft,
            slo_tpot=params.slo_tpot,
        )
        return cls(request_id, list(prompt), len(prompt), params, times, index=index)

    @property
    def key(self) -> tuple[str, int]:
        """This choice's identity: the request and the choice's index."""
        return self.request_id, self.index

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
