"""One token budget per step: running requests first, then waiting ones; chunked prefill; preemption.

There is no prefill phase and no decode phase, only token counts against a budget: a
decode costs one token, a prefill as many as fit. When the cache runs out of blocks the
most recently admitted request is preempted: its blocks are freed and it waits at the
head of the queue to be recomputed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # computed this step, from seq.num_computed_tokens on

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so its next token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_preempted: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = eos_token_ids
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate(seq, num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_tokens))
                budget -= num_tokens
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.num_preempted:
            seq = self.waiting[0]
            first_admission = seq.times.first_scheduled is None
            hits = self.block_manager.match_prefix(seq)
            cached = len(hits) * self.block_manager.block_size
            num_tokens = min(seq.num_tokens - cached, budget)
            if not self.block_manager.allocate(seq, num_tokens, hits):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if first_admission:
                seq.times.first_scheduled = time.monotonic()
                seq.num_cached_tokens = cached
                out.prefix_queried_tokens += seq.num_tokens
                out.prefix_hit_tokens += cached
            out.scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
        return out

    def update(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """Record computed tokens and sampled ones; return the sequences that got a new token."""
        advanced = []
        for item, token in zip(out.scheduled, sampled, strict=True):
            seq = item.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            seq.num_computed_tokens += item.num_tokens
            self.block_manager.commit(seq)
            if token is not None:
                seq.token_ids.append(token)
                advanced.append(seq)
                reason = self.stop_reason(seq, token)
                if reason:
                    self.finish(seq, reason)
        return advanced

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids:
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_seq(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
