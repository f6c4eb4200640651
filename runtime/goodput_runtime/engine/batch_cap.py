"""How many batch (low-priority) sequences may step beside online ones without costing them their TPOT.

On a CPU, and on a GPU past its memory-bound range, every sequence a decode step carries makes the
step slower, for every sequence in it. Batch work that shares steps with online decodes thus raises
the online requests' time per output token. The cap keeps it under the runtime's TPOT target
(``--slo-tpot``):

- ``StepTimeModel`` learns a step's time from the steps the engine runs (each step's whole cycle,
  from its scheduling to the next step's: the forward pass, the update, the detokenizing and the
  handlers between steps, which is the time between an online request's tokens): a fixed part, a cost per
  sequence decoding and a cost per prompt token (prefill, recomputation, speculative proposals),
  ``t(n, p) = fixed + per_seq · n + per_token · p``. Decode-only steps are averaged per batch size
  (running averages whose weight fades, so a machine that slows down or speeds up is followed) and a
  line is fitted through them; the cost per prompt token is what a step with prompt tokens took over
  the decode step of its size.
- ``BatchCap`` turns the model into the scheduler's limits for one step: with ``m`` online sequences
  running, the largest ``k`` with ``t(m + k, 0) + overhead`` within the budget (the target less a
  safety margin), and the prompt tokens of batch prefills that still fit. ``overhead`` is what the
  steps carrying online decodes took beyond the decode step of their size, on average: the prefills
  of newly admitted online requests those decodes wait through (such a step runs no batch work) and
  whatever the model misses. The online requests' TPOT is the mean of those steps, so the decode
  steps get the budget less the overhead. An online request already behind its target (its steps
  since its first token averaged more than the target, say after it waited through other requests'
  prefills) needs its remaining steps shorter still: its *allowance*, the mean step time that would
  just bring its TPOT back to the target over the tokens it has left, replaces the target where it is
  lower, as long as the request can still make it (a request that cannot is no reason to stop the
  batch). With no online sequence running batch decodes are not
  capped; batch prefills still keep a step within the budget (at least ``MIN_IDLE_PREFILL`` tokens,
  so the batch progresses), because an online request that arrives during a step waits for it to end.

Until a decode step is timed nothing is capped; with one batch size timed only, the whole step time is
taken as per-sequence cost (``fixed`` 0), which over-predicts larger batches: the cap errs on the safe
side until a second size is seen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

EWMA_WEIGHT = 0.2  # share of the newest measurement in a batch size's running average
OVERHEAD_WEIGHT = 0.05  # the same for the overhead: a slower average, over the steps of several requests
FADE = 0.995  # each decode step multiplies every batch size's weight by this: old sizes fade out
MAX_WEIGHT = 20.0  # a batch size's weight grows by one per step up to this
MIN_PREFILL_SAMPLE = 16  # prompt tokens a step needs to teach the cost per prompt token
MIN_IDLE_PREFILL = 16  # prompt tokens a batch prefill may always take while no online sequence runs


@dataclass
class SizeAverage:
    seconds: float
    weight: float


class StepTimeModel:
    """Predicted seconds of a step from the sequences it decodes and the prompt tokens it computes."""

    def __init__(self) -> None:
        self.sizes: dict[int, SizeAverage] = {}
        self.per_token: float | None = None  # seconds per prompt token
        self.fixed = 0.0
        self.per_seq = 0.0

    @property
    def measured(self) -> bool:
        return bool(self.sizes)

    @property
    def size_spread(self) -> int:
        """The largest batch size timed less the smallest: how far apart the sizes the line is fitted through lie."""
        return max(self.sizes) - min(self.sizes) if self.sizes else 0

    def mean_decode_seconds(self) -> float:
        """The decode steps' mean time over the batch sizes timed, by their weights (0 before any)."""
        total = sum(a.weight for a in self.sizes.values())
        return sum(a.seconds * a.weight for a in self.sizes.values()) / total if total else 0.0

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens == 0:
            if decodes:
                self._observe_decode(decodes, seconds)
            return
        if not self.sizes or prompt_tokens < MIN_PREFILL_SAMPLE:
            return  # a few prompt tokens tell the step's fixed cost, not the cost per token
        per_token = max(seconds - self.decode_seconds(decodes), seconds * 0.1) / prompt_tokens
        self.per_token = (
            per_token if self.per_token is None else ((1 - EWMA_WEIGHT) * self.per_token + EWMA_WEIGHT * per_token)
        )

    def _observe_decode(self, decodes: int, seconds: float) -> None:
        for faded in self.sizes.values():
            faded.weight *= FADE
        average = self.sizes.get(decodes)
        if average is None:
            self.sizes[decodes] = SizeAverage(seconds, 1.0)
        else:
            average.seconds = (1 - EWMA_WEIGHT) * average.seconds + EWMA_WEIGHT * seconds
            average.weight = min(average.weight + 1.0, MAX_WEIGHT)
        self._fit()

    def _fit(self) -> None:
        """fixed and per_seq: a weighted least-squares line through the batch sizes' averages, rising
        (a slope of at least a hundredth of the mean cost per sequence) and with no negative fixed part."""
        total = sum(a.weight for a in self.sizes.values())
        mean_n = sum(n * a.weight for n, a in self.sizes.items()) / total
        mean_t = sum(a.seconds * a.weight for a in self.sizes.values()) / total
        spread = sum(a.weight * (n - mean_n) ** 2 for n, a in self.sizes.items())
        floor = 0.01 * mean_t / mean_n
        if spread < 1e-9 * total:  # one batch size: all of its time is taken as per-sequence cost
            self.fixed, self.per_seq = 0.0, mean_t / mean_n
            return
        slope = sum(a.weight * (n - mean_n) * (a.seconds - mean_t) for n, a in self.sizes.items()) / spread
        slope = max(slope, floor)
        fixed = mean_t - slope * mean_n
        if fixed < 0:  # the line through the origin and the mean, the steeper one
            fixed, slope = 0.0, mean_t / mean_n
        self.fixed, self.per_seq = fixed, slope

    def decode_seconds(self, decodes: int) -> float:
        return self.fixed + self.per_seq * decodes

    def predict(self, decodes: int, prompt_tokens: int = 0) -> float | None:
        """Seconds of a step; None until a decode step is timed, or when it has prompt tokens and their
        cost is not yet known."""
        if not self.sizes or (prompt_tokens and self.per_token is None):
            return None
        return self.decode_seconds(decodes) + (self.per_token or 0.0) * prompt_tokens


@dataclass(frozen=True)
class StepLimits:
    """What batch work one step may carry."""

    sequences: int | None  # batch sequences stepping beside the online ones; None: not capped
    prefill_tokens: int | None  # prompt tokens of batch prefills; None: not capped


class BatchCap:
    """The scheduler's per-step limits on batch work, from the step-time model and the TPOT target."""

    def __init__(self, tpot_target: float, margin: float = 0.35) -> None:
        self.tpot_target = tpot_target
        self.margin = margin
        self.model = StepTimeModel()
        self.overhead = 0.0  # seconds the steps with online decodes took beyond their decode step, on average

    @property
    def budget(self) -> float:
        """Seconds one step may take: the TPOT target less the margin (steps that admit an online
        request run longer, and count into the same TPOT)."""
        return self.tpot_target * (1.0 - self.margin)

    def step_budget(self, online: int, allowances: Sequence[float] = ()) -> float:
        """Seconds this step's decodes may take: the budget, or less for an online request behind its
        target (its allowance less the margin) that can still make it, less the overhead."""
        overhead = max(self.overhead, 0.0)
        budget = self.budget
        least = self.model.decode_seconds(online) + overhead  # the step with no batch work at all
        for allowance in allowances:
            if least <= allowance * (1.0 - self.margin) < budget:
                budget = allowance * (1.0 - self.margin)
        return budget - overhead

    def sequences(self, online: int, allowances: Sequence[float] = ()) -> int | None:
        """Batch sequences that may decode beside `online` online sequences: None (not capped) when no
        online sequence runs or no step is timed yet, else the most whose step stays within budget.
        `allowances`: the online requests' mean step times that keep their TPOT within the target."""
        if online == 0 or not self.model.measured:
            return None
        room = self.step_budget(online, allowances) - self.model.decode_seconds(online)
        if room < 0:
            return 0
        return math.floor(room / self.model.per_seq + 1e-9)

    def prefill_tokens(self, online: int, decodes: int, allowances: Sequence[float] = ()) -> int | None:
        """Prompt tokens batch prefills may add to a step that decodes `decodes` sequences (online and
        batch) while `online` online sequences run. Beside online work, none until their cost is timed;
        with none running, at least MIN_IDLE_PREFILL."""
        floor = 0 if online else MIN_IDLE_PREFILL
        if not self.model.measured:
            return None
        if self.model.per_token is None:
            return None if not online else 0
        budget = self.step_budget(online, allowances) if online else self.budget
        room = budget - self.model.decode_seconds(decodes)
        return max(floor, math.floor(max(room, 0.0) / self.model.per_token))

    def limits(self, online: int, batch: int, allowances: Sequence[float] = ()) -> StepLimits:
        """This step's limits with `online` online and `batch` batch sequences running."""
        cap = self.sequences(online, allowances)
        decodes = online + (batch if cap is None else min(cap, batch))
        return StepLimits(cap, self.prefill_tokens(online, decodes, allowances))

    def allowance(self, since_first_token: float, num_output_tokens: int, max_tokens: int) -> float | None:
        """The mean step time over an online request's remaining tokens (up to max_tokens) that brings
        its TPOT, (e2e − TTFT) / (tokens − 1), to exactly the target; None when no token is left."""
        left = max_tokens - num_output_tokens
        if left <= 0 or num_output_tokens < 1:
            return None
        return (self.tpot_target * (num_output_tokens - 1 + left) - since_first_token) / left

    def observe(self, decodes: int, prompt_tokens: int, seconds: float, online_decodes: int = 0) -> None:
        """A step ran: `decodes` sequences decoding (`online_decodes` of them online), `prompt_tokens`
        other tokens, in `seconds`."""
        if online_decodes and self.model.measured:
            extra = seconds - self.model.decode_seconds(decodes)
            self.overhead = (1 - OVERHEAD_WEIGHT) * self.overhead + OVERHEAD_WEIGHT * extra
        self.model.observe(decodes, prompt_tokens, seconds)
