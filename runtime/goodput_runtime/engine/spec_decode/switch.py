"""Whether a step speculates: only while the running batch is small enough that verifying k
proposed tokens per sequence costs less than it saves.

A verification step computes k + 1 tokens per sequence instead of one. On a small batch the
forward pass is bound by reading the weights, and k + 1 tokens cost little more than one; on a
large batch it is bound by compute and they cost up to k + 1 times as much, slowing every request
down. The threshold is the largest running batch at which a step of k + 1 tokens per sequence
costs less than the tokens a verification is expected to yield, timed at start-up on the real
model (or given with --speculative-max-batch).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# the acceptance rate per proposed token the start-up threshold assumes: at 0.5 a verification of
# k tokens yields (1 - 0.5 ** (k + 1)) / 0.5 tokens on average, nearly two
ASSUMED_ACCEPTANCE = 0.5
MAX_TIMED_BATCH = 64
ROUNDS = 2  # each step shape is timed in this many turns, the fastest kept


def expected_tokens(k: int, acceptance: float = ASSUMED_ACCEPTANCE) -> float:
    """Tokens a verification of k proposals yields on average (the accepted ones and the target's own)."""
    return sum(acceptance**i for i in range(k + 1))


def measure_max_batch(step_seconds: Callable[[int, int], float], k: int, max_num_seqs: int) -> tuple[int, dict]:
    """The largest batch (powers of two up to max_num_seqs) at which a step of k + 1 tokens per
    sequence costs less than expected_tokens(k) steps of one; 0 when even one sequence does not gain.
    step_seconds(batch, tokens per sequence) times one forward pass. Also the cost ratios measured."""
    break_even = expected_tokens(k)
    best = 0
    ratios: dict[int, float] = {}
    batch = 1
    while batch <= min(max_num_seqs, MAX_TIMED_BATCH):
        one = many = float("inf")
        for _ in range(ROUNDS):  # in turns, so that a change of load on a shared machine weighs on both
            one = min(one, step_seconds(batch, 1))
            many = min(many, step_seconds(batch, k + 1))
        ratio = many / one
        ratios[batch] = round(ratio, 3)
        if ratio >= break_even:
            break
        best = batch
        batch *= 2
    if best == min(max_num_seqs, MAX_TIMED_BATCH) and best < max_num_seqs:
        best = max_num_seqs  # it still paid at the largest batch timed
    return best, ratios


class SpeculationSwitch:
    """The per-step decision, logged when it flips."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.active: bool | None = None

    def decide(self, num_running: int) -> bool:
        active = 0 < num_running <= self.max_batch
        if active != self.active and num_running:
            log.info(
                "Speculative decoding %s: %d running requests, threshold %d",
                "on" if active else "off",
                num_running,
                self.max_batch,
            )
            self.active = active
        return active


def timer(run: Callable[[int, int], object], repeats: int = 3) -> Callable[[int, int], float]:
    """step_seconds for measure_max_batch: the fastest of `repeats` runs, after one untimed."""

    def step_seconds(batch: int, tokens: int) -> float:
        run(batch, tokens)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            run(batch, tokens)
            best = min(best, time.perf_counter() - started)
        return best

    return step_seconds


def step_costs(step_seconds: Callable[[int, int], float], k: int) -> list[float]:
    """What a step of t = 1..k + 1 tokens for one sequence costs, relative to a step of one token:
    what prompt lookup picks its proposal lengths from. Timed in turns, the fastest of each kept."""
    best = [float("inf")] * (k + 1)
    for _ in range(ROUNDS):
        for t in range(1, k + 2):
            best[t - 1] = min(best[t - 1], step_seconds(1, t))
    return [round(c / best[0], 3) for c in best]
