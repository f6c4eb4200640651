"""Scheduling for the service's SLO: how many prompt tokens online prefills take in a step that
carries online decodes, and which waiting online request is admitted next.

Off by default; ``--slo-scheduling on``. A request's own targets (``x-goodput-slo-ttft-ms`` and
``-tpot-ms``, server/request_slo.py) stand in for the service's (``--slo-ttft``, ``--slo-tpot``) for that
request: its deadline is its own, and the TPOT the online decodes keep to is the tightest of theirs.
Measured with
``bench.slo_capacity`` on open-loop traffic (bench/README.md), it did not pay: against the same runtime
with it off, attainment 90.9 / 77.5 / 61.8 % against 95.5 / 80.0 / 81.8 % at 0.5, 1 and 1.5 req/s
(TTFT 2 s, TPOT 100 ms), TTFT p90 1.5-1.7 s against 0.9-1.4 s, and no better TPOT. Both use the
step-time model the batch cap learns (batch_cap.py): ``t(n, p) = fixed + per_seq · n + per_token · p``.

**Prefill chunks sized to the decodes' TPOT slack.** A fixed token budget per step
(``--max-num-batched-tokens``) lets one long prompt stretch the step of every running decode: on a
CPU a 2,048-token chunk is several times a decode step. With online decodes running, online
prefills get the prompt tokens that keep the step within the TPOT target less a margin (or less,
for a decode already behind its target that can still make it), at least ``MIN_CHUNK`` so prefills
progress. Where that is too few for a prompt to meet its own TTFT, the chunk grows to what the most
urgent prompt that can still make it needs: to compute ``T`` tokens by its deadline less the margin
(``τ`` seconds away), in steps of ``d + c·k`` seconds that each take ``k`` of them, ``k ≥ T·d / (τ − T·c)``, where
``T`` counts the prompt tokens queued ahead of it too.

**Waiting prompts ordered by TTFT deadline.** Each waiting online request's deadline is its
arrival plus the TTFT target. Requests that can still make it go first, earliest deadline first.
One that can no longer make it (the time left is less than its own prefill would take) goes behind
every request that can, in arrival order: past capacity, serving a lost request first makes the
ones behind it late as well. Ageing bounds the wait: a request that has waited ``AGEING`` TTFT
targets goes first again. A request preempted after its first token has no TTFT left to meet and
keeps its place at the front.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from goodput_runtime.engine.batch_cap import StepTimeModel
from goodput_runtime.engine.sequence import Sequence

MIN_CHUNK = 64  # prompt tokens an online prefill may always take in a step with online decodes
AGEING = 4.0  # a lost request waits at most this many TTFT targets behind the ones that can make it


def tightest_tpot(seqs: Iterable[Sequence], default: float | None) -> float | None:
    """The tightest TPOT target among the online sequences of `seqs`: each its own, else `default`."""
    targets = [default if s.params.slo_tpot is None else s.params.slo_tpot for s in seqs if s.params.priority <= 0]
    return min((t for t in targets if t is not None), default=None)


@dataclass
class SloSchedule:
    ttft_target: float | None  # seconds
    tpot_target: float | None
    margin: float = 0.2  # a step keeps to tpot_target × (1 − margin)
    max_chunk: int = 2048  # the step's token budget
    model: StepTimeModel = field(default_factory=StepTimeModel)  # the batch cap's, when there is one

    def ttft_of(self, seq: Sequence) -> float | None:
        """The request's own TTFT target, else the service's."""
        return self.ttft_target if seq.params.slo_ttft is None else seq.params.slo_ttft

    def deadline(self, seq: Sequence) -> float | None:
        ttft = self.ttft_of(seq)
        if ttft is None or seq.times.first_token is not None:
            return None
        return seq.times.arrival + ttft

    @property
    def timed(self) -> bool:
        return self.model.measured and self.model.per_token is not None

    def prefill_seconds(self, tokens: int, decodes: int) -> float:
        """The least time `tokens` prompt tokens take beside `decodes` decodes, in full chunks."""
        if not self.timed:
            return 0.0
        steps = math.ceil(tokens / max(1, self.max_chunk))
        return tokens * (self.model.per_token or 0.0) + steps * self.model.decode_seconds(decodes)

    def can_make_it(self, seq: Sequence, now: float, decodes: int) -> bool:
        deadline = self.deadline(seq)
        if deadline is None:
            return True
        return deadline - now >= self.prefill_seconds(seq.num_uncomputed_tokens, decodes)

    def next_waiting(self, waiting: Iterable[Sequence], now: float, decodes: int) -> Sequence | None:
        """The waiting request of the lowest priority class to admit next (see the module's doc)."""
        best: Sequence | None = None
        best_key: tuple = ()
        for order, seq in enumerate(waiting):
            deadline = self.deadline(seq)
            if deadline is None:  # preempted after its first token, or no TTFT target: arrival order
                rank: tuple = (0, order)
            elif now - seq.times.arrival >= AGEING * (self.ttft_of(seq) or 0.0):
                rank = (0, order)
            elif self.can_make_it(seq, now, decodes):
                rank = (1, deadline)
            else:
                rank = (2, order)
            key = (seq.params.priority, *rank)
            if best is None or key < best_key:
                best, best_key = seq, key
        return best

    def step_chunk(
        self,
        running: Seq[Sequence],
        waiting: Iterable[Sequence],
        batch_seats: int | None,
        allowances: Seq[float],
        now: float,
    ) -> tuple[int | None, int]:
        """Prompt tokens online prefills may take this step (None: no limit), and the sequences this
        step decodes (batch ones within `batch_seats`): with online decodes running, what their TPOT leaves."""
        decoding = [s for s in running if s.num_uncomputed_tokens == 1]
        online = sum(1 for s in decoding if s.params.priority <= 0)
        batch = len(decoding) - online
        decodes = online + (batch if batch_seats is None else min(batch, batch_seats))
        if not online:
            return None, decodes
        queued = [s for s in running if s.params.priority <= 0 and s.num_uncomputed_tokens > 1]
        queued += [s for s in waiting if s.params.priority <= 0]
        tpot = tightest_tpot(decoding, self.tpot_target)
        return self.online_chunk(decodes, allowances, queued, now, tpot), decodes

    def online_chunk(
        self,
        decodes: int,
        allowances: Seq[float],
        queued: Seq[Sequence],
        now: float,
        tpot: float | None = None,
    ) -> int | None:
        """Prompt tokens online prefills may take in a step that decodes `decodes` sequences, some
        of them online; None: no limit (no TPOT target, or the costs are not yet timed).
        `queued`: the online requests still in prefill, in the order they will be served. `tpot`: the
        target the online decodes keep to (the service's when None)."""
        tpot = self.tpot_target if tpot is None else tpot
        if tpot is None or not self.timed:
            return None
        per_token, step = self.model.per_token or 0.0, self.model.decode_seconds(decodes)
        budget = tpot * (1.0 - self.margin)
        for allowance in allowances:  # a decode behind its target that can still make it
            if step <= allowance * (1.0 - self.margin) < budget:
                budget = allowance * (1.0 - self.margin)
        chunk = max(MIN_CHUNK, math.floor(max(budget - step, 0.0) / per_token))
        ahead = 0
        for seq in queued:  # the most urgent prompt that can still make its TTFT
            ahead += seq.num_uncomputed_tokens
            deadline, ttft = self.deadline(seq), self.ttft_of(seq)
            if deadline is None or ttft is None:
                continue
            # aim inside the target by the margin: the first token still has its step and its way out
            room = deadline - self.margin * ttft - now - ahead * per_token
            if room <= 0:
                continue  # lost whatever the chunk: no reason to stretch the decodes' steps for it
            need = math.ceil(ahead * step / room)
            if need <= self.max_chunk:
                chunk = max(chunk, need)
        return min(chunk, self.max_chunk)
