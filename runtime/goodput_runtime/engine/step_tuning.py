"""Step tuning on a CPU: per step size, the thread count and the form of the matrix products that run it
fastest, timed at start-up.

A decode step on a CPU is a chain of matrix products with as many rows as the step has tokens. Two
choices that the BLAS library makes badly for the small steps of decoding, and that differ from one
machine to the next, are measured here instead of guessed:

- **Threads.** A step of a few tokens reads every weight once and is bound by memory bandwidth. On
  two hyperthreads of one core a second thread adds synchronization and no bandwidth (measured on
  this project's 2-vCPU machine: batch 1 56 ms with one thread, 61 with two; batch 4 81 against
  100), while a step of 64 tokens gains from both (331 against 257 ms). On a host with more real
  cores the balance moves, so it is timed.
- **The form of the product.** ``F.linear(x, W)`` with 2 to 8 rows takes a slow small-matrix path
  in MKL (SmolLM2's projections and LM head: 88 ms for 2 rows against 45 for one), while the same
  product written as ``W @ x^T`` runs at the one-row speed (28 ms). Both compute the same sums,
  in a different order, so the outputs agree to float rounding.

For each token count in COUNTS up to the engine's largest decode step, every combination (the pool's
threads or one, either form) times a decode step of that many sequences, in turns; the fastest wins
where it beats the default (all threads, ``F.linear``) by more than MARGIN. A step of a size between
two timed counts runs as the smaller one; larger steps (prefill chunks) keep the default.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

COUNTS = (1, 2, 3, 4, 6, 8, 16, 32, 64)
ROUNDS = 2  # timed runs of each combination, in turns, after one untimed
MARGIN = 0.05  # a combination other than the default must be this much faster


@dataclass(frozen=True)
class StepPlan:
    """How a step of a given number of tokens runs: its threads, and whether the decoder layers'
    projections and the LM head compute ``W @ x^T`` (transposed) rather than ``F.linear``. The
    layers go by the step's token count, the LM head by the rows it keeps. Counts past the last
    one, and every count when `counts` is empty, run with `pool` threads and ``F.linear``."""

    pool: int
    counts: tuple[int, ...] = ()
    threads: tuple[int, ...] = ()
    layers_transposed: tuple[bool, ...] = ()
    head_transposed: tuple[bool, ...] = ()
    limit: int = 0  # the counts cover steps of up to this many tokens

    def _at(self, tokens: int) -> int | None:
        if not self.counts or tokens > self.limit or tokens < self.counts[0]:
            return None
        return bisect.bisect_right(self.counts, tokens) - 1

    def threads_for(self, tokens: int) -> int:
        i = self._at(tokens)
        return self.pool if i is None else self.threads[i]

    def layers_transposed_for(self, tokens: int) -> bool:
        i = self._at(tokens)
        return False if i is None else self.layers_transposed[i]

    def head_transposed_for(self, rows: int) -> bool:
        i = self._at(rows)
        return False if i is None else self.head_transposed[i]

    @classmethod
    def default(cls, pool: int) -> StepPlan:
        """Untimed: the LM head transposed for 2 to 8 rows (a verification step's; measured on SmolLM2
        6-9 ms against 17-25 ms for F.linear), everything else as the library does it."""
        return cls(pool, (1, 2), (pool, pool), (False, False), (False, True), limit=8)

    @classmethod
    def uniform(cls, threads: int, transposed: bool, limit: int) -> StepPlan:
        """One choice for every step up to `limit` tokens: what tuning times."""
        return cls(threads, (1,), (threads,), (transposed,), (transposed,), limit=limit)

    def describe(self) -> str:
        if not self.counts:
            return f"{self.pool} threads, F.linear, at every size"
        parts = []
        for i, count in enumerate(self.counts):
            end = self.counts[i + 1] - 1 if i + 1 < len(self.counts) else self.limit
            span = str(count) if end == count else f"{count}-{end}"
            form = "W@x^T" if self.layers_transposed[i] else "F.linear"
            if self.head_transposed[i] != self.layers_transposed[i]:
                form += f" (LM head {'W@x^T' if self.head_transposed[i] else 'F.linear'})"
            parts.append(f"{span}: {self.threads[i]} thread{'s' if self.threads[i] > 1 else ''}, {form}")
        return "; ".join(parts) + f"; larger steps {self.pool} threads, F.linear"


def tune(step_seconds: Callable[[StepPlan, int], float], pool: int, max_tokens: int,
         clock: Callable[[], float] = time.monotonic) -> tuple[StepPlan, dict[int, dict[str, float]]]:
    """The plan from timing: step_seconds(plan, tokens) runs one decode step of `tokens` sequences
    under `plan` and returns its seconds. Also the times measured, in ms by count and combination."""
    counts = [c for c in COUNTS if c <= max_tokens] or [1]
    limit = max(counts)
    combos = [(pool, False), (pool, True)] + ([(1, False), (1, True)] if pool > 1 else [])
    threads, transposed, measured = [], [], {}
    started = clock()
    for count in counts:
        plans = [StepPlan.uniform(t, f, limit) for t, f in combos]
        best = [float("inf")] * len(plans)
        for plan in plans:
            step_seconds(plan, count)  # untimed: caches and the thread pool settle on this shape
        for _ in range(ROUNDS):  # in turns, so that a change of load weighs on every combination
            for i, plan in enumerate(plans):
                best[i] = min(best[i], step_seconds(plan, count))
        pick = min(range(len(plans)), key=best.__getitem__)
        if best[pick] > best[0] * (1 - MARGIN):
            pick = 0
        threads.append(combos[pick][0])
        transposed.append(combos[pick][1])
        measured[count] = {f"{t}{'T' if f else ''}": round(1000 * s, 2)
                           for (t, f), s in zip(combos, best, strict=True)}
    # consecutive counts with the same choice merge into one span
    choices = list(zip(threads, transposed, strict=True))
    keep = [i for i in range(len(counts)) if i == 0 or choices[i] != choices[i - 1]]
    plan = StepPlan(pool, tuple(counts[i] for i in keep), tuple(threads[i] for i in keep),
                    tuple(transposed[i] for i in keep), tuple(transposed[i] for i in keep), limit=limit)
    log.info("Step tuning (%.1f s): %s", clock() - started, plan.describe())
    return plan, measured
