"""One token budget per step: running requests first, then waiting ones; chunked prefill; preemption.

There is no prefill phase and no decode phase, only token counts against a budget: a
decode costs one token, a prefill as many as fit. When the cache runs out of blocks the
most recently admitted request is preempted: its blocks are freed and it waits at the
head of the queue to be recomputed.

A request with several choices is scheduled as one sequence until its prefill ends; the step
that samples its first token samples one for every choice, and the other choices fork from it
there, sharing its blocks (see block_manager.py). From then on each choice is a sequence of its
own: scheduled, preempted and recomputed like any other.

Priority (vLLM's convention: lower first, 0 by default; above 0 is batch work): the waiting
request admitted next is the first of the lowest priority, so batch requests are admitted only
while no online one waits; a step that admits an online request runs no batch work at all (no
batch prefill, no batch decode), and a batch request is preempted to make room (blocks or a
seat) for it. Batch prefills get at most an eighth of a step's token budget. Running requests
are served in priority order, so when blocks run out the victim is the most recently admitted
of the lowest priority.

With a TPOT target (``batch_cap``, see batch_cap.py) batch work also keeps the online decodes'
steps short: while online sequences run, at most the cap's number of batch sequences step beside
them (the earliest admitted; the others are paused: they keep their blocks and seat and skip the
step, so their output is the one they would have had alone), and batch prefills take only the
prompt tokens that still fit the step's time budget. With no online sequence running the batch
fills the seats freely; the paused sequences resume as soon as the online ones leave or the cap
rises. A paused sequence that holds blocks an online request needs is preempted like any other.

With speculative decoding a decode carries the tokens proposed for it (``drafts``, set at the end
of the previous step) when the switch allows it this step: its KV slots are allocated with the
decode's and the target verifies them in the same forward pass. ``update`` keeps the accepted
prefix and rolls back the rest: the computed count stops after the last accepted token and the
blocks past it go back to the free list, so block tables and prefix-cache hashes only ever hold
real tokens.
"""

from __future__ import annotations

import time
from collections import deque

from goodput_runtime.engine.batch_cap import BatchCap
from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.kv_transfer.leases import LeaseTable
from goodput_runtime.engine.lora_manager import LoraManager, LoraNotFound
from goodput_runtime.engine.schedule_output import ScheduledSeq, SchedulerOutput, is_batch
from goodput_runtime.engine.sequence import SeqStatus, Sequence
from goodput_runtime.engine.sequence_updates import SequenceUpdates
from goodput_runtime.engine.slo_schedule import SloSchedule
from goodput_runtime.engine.spec_decode.switch import SpeculationSwitch

__all__ = ["BATCH_PREFILL_SHARE", "LORA_AGEING_S", "ScheduledSeq", "Scheduler", "SchedulerOutput", "is_batch"]

# a waiting request whose LoRA adapter finds no free slot is passed over; once one has waited this
# long, no newer request on another adapter is admitted until it has its slot (base requests still are)
LORA_AGEING_S = 2.0
BATCH_PREFILL_SHARE = 8  # batch prefills take at most 1/8 of a step's token budget: a step an online


# request arrives during stays short, so its wait for the next step does too
class Scheduler(SequenceUpdates):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.switch: SpeculationSwitch | None = None  # set when speculative decoding is configured
        self.drafts: dict[Sequence, list[int]] = {}  # proposals for each sequence's next step
        self.batch_cap: BatchCap | None = None  # set when a TPOT target caps batch work beside online work
        self.slo: SloSchedule | None = None  # set when the service's SLO orders prompts and sizes their chunks
        self.lora: LoraManager | None = None  # set when LoRA adapters are enabled: their slots
        self.lora_failed: list[Sequence] = []  # waiting sequences whose adapter was unloaded: finished by the core
        # KV hand-offs (engine/kv_transfer/): sequences parked while their prompt's blocks arrive, and
        # on a prefill runtime the leases finished prompts' blocks are held under
        self.parked: list[Sequence] = []
        self.leases: LeaseTable | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_waiting_batch(self) -> int:
        return sum(1 for s in self.waiting if is_batch(s))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda s: s.params.priority)  # stable: admission order within a priority
        online_waiting = any(not is_batch(s) for s in self.waiting)
        batch_prefill = max(1, self.max_num_batched_tokens // BATCH_PREFILL_SHARE)
        batch_seats: int | None = None  # batch sequences this step may still carry; None: any number
        allowances: list[float] = []
        if self.batch_cap is not None:
            online = sum(1 for s in self.running if not is_batch(s))
            allowances = self._allowances()
            limits = self.batch_cap.limits(online, len(self.running) - online, allowances)
            batch_seats = out.batch_cap = limits.sequences
            if limits.prefill_tokens is not None:
                batch_prefill = min(batch_prefill, limits.prefill_tokens)
        now = time.monotonic()
        online_prefill, decoding = (
            (None, 0)
            if self.slo is None
            else self.slo.step_chunk(self.running, self.waiting, batch_seats, allowances, now)
        )
        drafts, self.drafts = self.drafts, {}
        out.speculative = self.switch is not None and self.switch.decide(len(self.running))
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            prefill = seq.num_uncomputed_tokens > 1
            if is_batch(seq) and (online_waiting or (prefill and batch_prefill <= 0)):
                i += 1  # batch work pauses for a step that admits an online request
                continue
            if is_batch(seq) and batch_seats is not None:
                if batch_seats <= 0:
                    out.batch_paused += 1  # beyond the cap: it sits this step out, keeping its blocks
                    i += 1
                    continue
                batch_seats -= 1
            draft = self._fit_draft(seq, drafts.get(seq), budget) if out.speculative else []
            if draft and self.block_manager.allocate(seq, 1 + len(draft)):
                out.scheduled.append(self._scheduled(seq, 1 + len(draft), draft))
                budget -= 1 + len(draft)
                i += 1
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if is_batch(seq) and prefill:
                num_tokens = min(num_tokens, batch_prefill)
                batch_prefill -= num_tokens
            elif prefill and online_prefill is not None:
                num_tokens = min(num_tokens, online_prefill)
                if num_tokens <= 0:
                    i += 1  # the decodes' TPOT has no room left for more prompt this step
                    continue
                online_prefill -= num_tokens
            while not self.block_manager.allocate(seq, num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                out.scheduled.append(self._scheduled(seq, num_tokens))
                budget -= num_tokens
                i += 1
        evicted = 0
        passed: set[Sequence] = set()  # waiting sequences whose adapter found no slot this step
        while self.waiting and budget > 0 and out.num_preempted == evicted:
            candidate = self._next_waiting(now, decoding, passed)
            if candidate is None:
                break
            seq = candidate
            if seq.cache_salt and self.lora is not None and not self._lora_slot(seq, passed, now):
                passed.add(seq)
                continue
            if not self._room_for(seq):
                freed = self._evict_batch_for(seq, out)
                if freed is None:
                    break
                budget, evicted = budget + freed, out.num_preempted
                continue
            first_admission = seq.times.first_scheduled is None
            # a hand-off's sequence arrives holding the blocks that landed for it (kv_transfer/agent.py)
            landed = bool(seq.block_table)
            skip = self._needs_every_position(seq) or landed
            hits = [] if skip else self.block_manager.match_prefix(seq)
            loads = [] if skip else self.block_manager.match_offloaded(seq, len(hits))
            cached = (len(hits) + len(loads)) * self.block_manager.block_size or seq.num_computed_tokens
            num_tokens = min(seq.num_tokens - cached, budget)
            if is_batch(seq):  # only batch requests wait now (the lowest priority comes first)
                num_tokens = min(num_tokens, batch_prefill)
                if num_tokens <= 0 or online_waiting or (batch_seats is not None and batch_seats <= 0):
                    break
            elif online_prefill is not None:
                num_tokens = min(num_tokens, online_prefill)
                if num_tokens <= 0:
                    break
            if not self.block_manager.allocate(seq, num_tokens, hits, loads):
                if self._drop_landed(seq):
                    continue
                freed = self._evict_batch_for(seq, out)
                if freed is None:
                    break
                budget, evicted = budget + freed, out.num_preempted
                continue
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if first_admission:
                seq.times.first_scheduled = time.monotonic()
                cached = seq.num_computed_tokens  # fewer than found when an offloaded entry did not verify
                seq.num_cached_tokens = cached
                if not landed:  # a hand-off's blocks were found or pulled by its own lookup (kv_transfer/)
                    out.prefix_queried_tokens += seq.num_tokens
                    out.prefix_hit_tokens += cached
                    out.offload_hit_tokens += max(0, cached - len(hits) * self.block_manager.block_size)
            out.scheduled.append(self._scheduled(seq, num_tokens))
            budget -= num_tokens
            if not is_batch(seq) and online_prefill is not None:
                online_prefill -= num_tokens
            if is_batch(seq):
                batch_prefill -= num_tokens
                if batch_seats is not None:
                    batch_seats -= 1
        for item in out.scheduled:
            if item.num_tokens - len(item.draft) == 1 and item.seq.num_uncomputed_tokens == 1:
                out.num_decodes += 1
                out.num_online_decodes += not is_batch(item.seq)
                out.num_prompt_tokens += len(item.draft)
            else:
                out.num_prompt_tokens += item.num_tokens
        if out.scheduled and (self.block_manager.pending_saves or self.block_manager.pending_loads):
            out.kv_saves, out.kv_loads = self.block_manager.take_transfers()
        return out

    def _allowances(self) -> list[float]:
        """Each online sequence's mean step time left that keeps its TPOT within the target (batch_cap.py)."""
        assert self.batch_cap is not None
        now = time.monotonic()
        allowances = []
        for seq in self.running:
            if not is_batch(seq) and seq.times.first_token is not None:
                allowance = self.batch_cap.allowance(
                    now - seq.times.first_token, seq.num_output_tokens, seq.params.max_tokens
                )
                if allowance is not None:
                    allowances.append(allowance)
        return allowances

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The forward pass of `out` took `seconds`: what the batch cap's step-time model learns from."""
        policy = self.block_manager.reload_policy
        if policy is not None and out.num_prompt_tokens >= 4 * max(1, out.num_decodes):
            policy.observe_prefill(out.num_prompt_tokens, seconds)  # what a reload is weighed against
        if self.batch_cap is not None:
            self.batch_cap.observe(out.num_decodes, out.num_prompt_tokens, seconds, out.num_online_decodes)
        if self.slo is not None and (self.batch_cap is None or self.slo.model is not self.batch_cap.model):
            self.slo.model.observe(out.num_decodes, out.num_prompt_tokens, seconds)

    def _next_waiting(self, now: float, decodes: int, passed: set[Sequence] | None = None) -> Sequence | None:
        """The first waiting request of the lowest priority (preempted ones are at the front); with
        the SLO's scheduling, by TTFT deadline among those that can still make it (slo_schedule.py).
        Those in `passed` (their adapter found no slot) are not considered; None when only they wait."""
        waiting = self.waiting if not passed else deque(s for s in self.waiting if s not in passed)
        if not waiting:
            return None
        if self.slo is not None:
            chosen = self.slo.next_waiting(waiting, now, decodes)
            if chosen is not None:
                return chosen
        best = waiting[0]
        for seq in waiting:
            if seq.params.priority < best.params.priority:
                best = seq
        return best

    def _lora_slot(self, seq: Sequence, passed: set[Sequence], now: float) -> bool:
        """Whether seq's adapter has a slot (placing it there if one is free or idle). Once a request
        passed over this step has waited LORA_AGEING_S, no newer request on another adapter is admitted
        (base-model requests still are), so the slots drain to it. An adapter unloaded since the request
        came finishes it (the core reports it)."""
        assert self.lora is not None
        key = seq.cache_salt
        starving = any(s.cache_salt != key and now - s.times.arrival > LORA_AGEING_S for s in passed)
        if starving and now - seq.times.arrival <= LORA_AGEING_S:
            return False  # the slots drain: the running sequences finish and the starving adapter gets one
        busy = {s.cache_salt for s in self.running if s.cache_salt}
        try:
            return self.lora.acquire(key, busy) is not None
        except LoraNotFound:
            self.waiting.remove(seq)
            self.lora_failed.append(seq)
            return False

    def _drop_landed(self, seq: Sequence) -> bool:
        """Free the blocks other waiting sequences hold from a KV hand-off, so that `seq` (at the head
        of the queue) is not kept waiting on them; they stay findable by prefix (published when they
        landed) and are matched again at admission. False when none holds any."""
        holders = [s for s in self.waiting if s is not seq and s.block_table]
        for holder in holders:
            self.block_manager.free_seq(holder)
        return bool(holders)

    def _evict_batch_for(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        """Preempt the most recently admitted batch request to make room for online `seq`; None when
        `seq` is itself batch work or no batch request runs. A victim already scheduled this step is
        taken out of the step: the tokens it gives back to the budget are returned."""
        if is_batch(seq):
            return None
        victim = next((s for s in reversed(self.running) if is_batch(s)), None)
        if victim is None:
            return None
        freed = sum(item.num_tokens for item in out.scheduled if item.seq is victim)
        out.scheduled = [item for item in out.scheduled if item.seq is not victim]
        self.running.remove(victim)
        self._preempt(victim)
        out.num_preempted += 1
        return freed

    @staticmethod
    def _needs_every_position(seq: Sequence) -> bool:
        """Prompt logprobs need the logits of every prompt position, mean pooling the hidden state of
        every one: such a prompt never reuses the prefix cache (it still fills it for others). Last-token
        pooling may reuse it, as the prompt's last token is always computed."""
        return seq.params.prompt_logprobs is not None or (seq.pooling is not None and seq.pooling.mode == "mean")

    def _room_for(self, seq: Sequence) -> bool:
        """Whether seq (with the choices that will fork from it) may join the running batch: within
        --max-num-seqs, or alone when it has more choices than that."""
        return len(self.running) + 1 + len(seq.forks) <= self.max_num_seqs or not self.running

    def _fit_draft(self, seq: Sequence, draft: list[int] | None, budget: int) -> list[int]:
        """The part of a decode's proposal this step can verify: within the token budget, the model's
        length and the request's max_tokens (the step also yields one token of the target's)."""
        if not draft or seq.num_uncomputed_tokens != 1:
            return []
        room = min(budget - 1, self.max_model_len - seq.num_tokens, seq.params.max_tokens - seq.num_output_tokens - 1)
        return draft[: max(room, 0)]

    def _scheduled(self, seq: Sequence, num_tokens: int, draft: list[int] | None = None) -> ScheduledSeq:
        copies, seq.block_copies = seq.block_copies, []
        scheduled = ScheduledSeq(seq, num_tokens, copies, draft=draft or [])
        if seq.cache_salt and self.lora is not None:
            scheduled.lora_slot = self.lora.slot_of(seq.cache_salt)
        if seq.params.prompt_logprobs is not None:
            start = max(seq.num_computed_tokens, seq.num_prompt_logprob_positions)
            stop = min(seq.num_computed_tokens + num_tokens, seq.num_prompt_tokens - 1)
            if stop > start:
                scheduled.prompt_logprobs = range(start, stop)
                seq.num_prompt_logprob_positions = stop
        return scheduled
