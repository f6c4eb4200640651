"""After a step: the scheduler's side of advancing its sequences (engine/scheduler.py's ``Scheduler``
inherits it). Computed tokens are counted, sampled tokens appended up to the first that stops a sequence,
the choices of a request fork from its first at the end of its prefill, and finished or preempted
sequences give their blocks back (or, for a prefill runtime's hand-off, keep them under a lease)."""

from __future__ import annotations

from collections import deque

from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.kv_transfer.leases import LeaseTable
from goodput_runtime.engine.schedule_output import SchedulerOutput
from goodput_runtime.engine.sequence import SeqStatus, Sequence


class SequenceUpdates:
    block_manager: BlockManager
    eos_token_ids: frozenset[int]
    max_model_len: int
    waiting: deque[Sequence]
    running: list[Sequence]
    parked: list[Sequence]
    drafts: dict[Sequence, list[int]]
    leases: LeaseTable | None

    def update(
        self,
        out: SchedulerOutput,
        sampled: list[int | None],
        fork_tokens: dict[int, list[int]] | None = None,
        accepted: dict[int, list[int]] | None = None,
        proposals: dict[int, list[int]] | None = None,
    ) -> list[Sequence]:
        """Record computed tokens and sampled ones; return the sequences that got new tokens, and the
        embedding requests whose prompt this step completed (finished here).
        By scheduled position: fork_tokens, the first tokens of the choices forking there; accepted,
        the proposed tokens the target kept (before its own sampled token); proposals, tokens proposed
        for the sequence's next step."""
        advanced: list[Sequence] = []
        for pos, (item, token) in enumerate(zip(out.scheduled, sampled, strict=True)):
            seq = item.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            kept = (accepted or {}).get(pos, [])
            seq.num_computed_tokens += item.num_tokens - len(item.draft) + len(kept)
            if item.draft:
                self.block_manager.trim(seq)  # the rejected proposals' slots
            else:
                self.block_manager.commit(seq)
            if token is None:
                if seq.pooling is not None and not seq.num_uncomputed_tokens:
                    # an embedding request: its prompt is complete and pooled, nothing to generate
                    advanced.append(seq)
                    self.finish(seq, "stop")
                continue
            forks, seq.forks = seq.forks, []
            for child, child_token in zip(forks, (fork_tokens or {}).get(pos, []), strict=True):
                self.block_manager.fork(seq, child)
                child.num_prompt_logprob_positions = seq.num_prompt_logprob_positions
                child.status = SeqStatus.RUNNING
                self.running.append(child)
                self._advance(child, [child_token], advanced)
            self._advance(seq, [*kept, token], advanced)
            if item.draft and not seq.is_finished:
                self.block_manager.commit(seq)  # now that the accepted tokens are in token_ids
            if pos in (proposals or {}) and not seq.is_finished:
                self.drafts[seq] = (proposals or {})[pos]
        return advanced

    def _advance(self, seq: Sequence, tokens: list[int], advanced: list[Sequence]) -> None:
        """Append tokens one by one, up to the first that stops the sequence (a grammar's end included)."""
        advanced.append(seq)
        if seq.params.max_tokens == 0:  # prompt logprobs only: the sampled token is not wanted
            self.finish(seq, "length")
            return
        for token in tokens:
            seq.token_ids.append(token)
            reason = self.stop_reason(seq, token)
            if seq.grammar is not None and not reason and (not seq.grammar.accept(token) or seq.grammar.terminated):
                reason = "stop"  # the grammar is complete (its stop token came, though EOS was ignored)
            if reason:
                self.finish(seq, reason)
                return

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
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
        elif seq.status is SeqStatus.WAITING_FOR_REMOTE_KV:
            self.parked.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.lease_kv and self.leases is not None and reason in ("stop", "length"):
            seq.kv_handoff = self.leases.hold(seq)  # its prompt blocks wait for a decode runtime's pull
        else:
            self.block_manager.free_seq(seq)
        self.drafts.pop(seq, None)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_seq(seq)
        self.drafts.pop(seq, None)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def park(self, seq: Sequence) -> None:
        """Hold seq outside the queue while its prompt's blocks are pulled from another runtime."""
        seq.status = SeqStatus.WAITING_FOR_REMOTE_KV
        self.parked.append(seq)

    def unpark(self, seq: Sequence) -> None:
        """Queue a parked seq: with the blocks that landed (computed), or none (computed here)."""
        if seq.status is not SeqStatus.WAITING_FOR_REMOTE_KV:
            return
        self.parked.remove(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
