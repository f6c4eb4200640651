"""Step tuning on a CPU: per step size, the thread count and the kernel of the matrix products that run it
fastest, timed at start-up.

A step on a CPU is a chain of matrix products with as many rows as the step has tokens. Which BLAS
kernel runs them fastest, and whether a second thread helps, differ from one machine to the next,
so they are measured here instead of guessed. Three forms of each projection ``x @ W^T``:

- ``linear``: ``F.linear(x, W)``, torch's default (MKL's GEMM on x86).
- ``transposed``: the same product as ``W @ x^T``. On the project's AMD machine MKL takes a slow
  small-matrix path for ``F.linear`` with 2 to 8 rows (SmolLM2's projections and LM head: 76 ms
  for 2 rows against 44 for one); the transposed product runs 2 rows in 28 ms.
- ``onednn``: oneDNN's matmul over a copy of the weight reordered once into its blocked layout
  (``mkldnn._reorder_linear_weight``), what inductor's CPU freezing and vLLM's CPU backend use.
  Measured there with two threads: one row 24 ms against 43, 16 rows 32 against 68, 64 rows 90
  against 136, 512 rows 676 against 784. It costs a second copy of each weight it covers.

The three compute the same sums in different orders, so outputs agree to float rounding.

For each token count in COUNTS up to the engine's largest decode step, every combination (the pool's
threads or one, each available form) times a decode step of that many sequences, in turns; the fastest
wins where it beats the default (the pool, ``linear``) by more than MARGIN, and oneDNN wins wherever it
comes within PREFER of the winner: a plan that is oneDNN throughout needs no unpacked weights, so the
packed copy then replaces them instead of doubling the memory they take. A combination DROP times
slower than the fastest at one count is not timed at the next. A step of a size between two timed
counts runs as the smaller one. Larger steps (prefill chunks) run with the pool's threads and the
form that timed fastest on a PREFILL-token prompt.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

COUNTS = (1, 2, 3, 4, 6, 8, 16, 32, 64)
PREFILL = 256  # tokens of the prompt that times the form of larger steps
ROUNDS = 2  # timed runs of each combination, in turns, after one untimed
MARGIN = 0.05  # a combination other than the default must be this much faster
PREFER = 0.15  # oneDNN wins where it comes within this of the fastest (its packed weights then replace the rest)
DROP = 1.5  # a combination this much slower than the fastest at one count is not timed at the next
LINEAR, TRANSPOSED, ONEDNN = "linear", "transposed", "onednn"
FORMS = (LINEAR, TRANSPOSED, ONEDNN)
SHOWN = {LINEAR: "F.linear", TRANSPOSED: "W@x^T", ONEDNN: "oneDNN"}


@dataclass(frozen=True)
class StepPlan:
    """How a step of a given number of tokens runs: its threads, and the form of the decoder layers'
    projections and of the LM head (one of FORMS). The layers go by the step's token count, the LM
    head by the rows it keeps. Counts past `limit`, and every count when `counts` is empty, run with
    `pool` threads and the `large` form."""

    pool: int
    counts: tuple[int, ...] = ()
    threads: tuple[int, ...] = ()
    layer_forms: tuple[str, ...] = ()
    head_forms: tuple[str, ...] = ()
    limit: int = 0  # the counts cover steps of up to this many tokens
    large: str = LINEAR

    def _at(self, tokens: int) -> int | None:
        if not self.counts or tokens > self.limit or tokens < self.counts[0]:
            return None
        return bisect.bisect_right(self.counts, tokens) - 1

    def threads_for(self, tokens: int) -> int:
        i = self._at(tokens)
        return self.pool if i is None else self.threads[i]

    def layer_form(self, tokens: int) -> str:
        i = self._at(tokens)
        return self.large if i is None else self.layer_forms[i]

    def head_form(self, rows: int) -> str:
        i = self._at(rows)
        return self.large if i is None else self.head_forms[i]

    def uses(self, form: str) -> bool:
        return form == self.large or form in self.layer_forms or form in self.head_forms

    def only(self, form: str) -> bool:
        return {self.large, *self.layer_forms, *self.head_forms} == {form}

    @classmethod
    def default(cls, pool: int) -> StepPlan:
        """Untimed: the LM head transposed for 2 to 8 rows (a verification step's; measured on SmolLM2
        6-9 ms against 17-25 ms for F.linear), everything else as the library does it."""
        return cls(pool, (1, 2), (pool, pool), (LINEAR, LINEAR), (LINEAR, TRANSPOSED), limit=8)

    @classmethod
    def uniform(cls, threads: int, form: str, limit: int) -> StepPlan:
        """One choice for every step (up to `limit` tokens; larger ones in the same form): what tuning times."""
        return cls(threads, (1,), (threads,), (form,), (form,), limit=limit, large=form)

    def describe(self) -> str:
        parts = []
        for i, count in enumerate(self.counts):
            end = self.counts[i + 1] - 1 if i + 1 < len(self.counts) else self.limit
            span = str(count) if end == count else f"{count}-{end}"
            form = SHOWN[self.layer_forms[i]]
            if self.head_forms[i] != self.layer_forms[i]:
                form += f" (LM head {SHOWN[self.head_forms[i]]})"
            parts.append(f"{span}: {self.threads[i]} thread{'s' if self.threads[i] > 1 else ''}, {form}")
        return "; ".join([*parts, f"larger steps {self.pool} threads, {SHOWN[self.large]}"])


def tune(
    step_seconds: Callable[[StepPlan, int], float],
    prefill_seconds: Callable[[StepPlan, int], float],
    pool: int,
    max_tokens: int,
    forms: tuple[str, ...] = FORMS,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[StepPlan, dict[int | str, dict[str, float]]]:
    """The plan from timing: step_seconds(plan, n) runs one decode step of n sequences under `plan`,
    prefill_seconds(plan, n) one n-token prompt; both return seconds. Also the times measured, in ms
    by count (and "prefill") and combination ("2 linear": two threads, F.linear)."""
    counts = [c for c in COUNTS if c <= max_tokens] or [1]
    limit = max(counts)
    combos = [(t, f) for t in ([pool, 1] if pool > 1 else [pool]) for f in forms]
    started = clock()

    def fastest(
        run: Callable[[StepPlan, int], float],
        tokens: int,
        choices: list[tuple[int, str]],
        key: int | str,
        measured: dict,
    ) -> tuple[int, str]:
        plans = [StepPlan.uniform(t, f, limit) for t, f in choices]
        best = [float("inf")] * len(plans)
        for plan in plans:
            run(plan, tokens)  # untimed: caches and the thread pool settle on this shape
        for _ in range(ROUNDS):  # in turns, so that a change of load weighs on every combination
            for i, plan in enumerate(plans):
                best[i] = min(best[i], run(plan, tokens))
        pick = min(range(len(plans)), key=best.__getitem__)
        if best[pick] > best[0] * (1 - MARGIN):
            pick = 0
        packed = [i for i, (_, f) in enumerate(choices) if f == ONEDNN and best[i] <= best[pick] * (1 + PREFER)]
        if packed:
            pick = min(packed, key=best.__getitem__)
        measured[key] = {f"{t} {f}": round(1000 * s, 2) for (t, f), s in zip(choices, best, strict=True)}
        return choices[pick]

    measured: dict[int | str, dict[str, float]] = {}
    chosen = []
    candidates = combos
    for count in counts:
        chosen.append(fastest(step_seconds, count, candidates, count, measured))
        times = measured[count]
        quickest = min(times.values())
        candidates = [c for i, c in enumerate(candidates) if i == 0 or times[f"{c[0]} {c[1]}"] <= DROP * quickest]
    _, large = fastest(prefill_seconds, PREFILL, [(pool, f) for f in forms], "prefill", measured)
    keep = [i for i in range(len(counts)) if i == 0 or chosen[i] != chosen[i - 1]]  # equal neighbours merge
    plan = StepPlan(
        pool,
        tuple(counts[i] for i in keep),
        tuple(chosen[i][0] for i in keep),
        tuple(chosen[i][1] for i in keep),
        tuple(chosen[i][1] for i in keep),
        limit=limit,
        large=large,
    )
    log.info("Step tuning (%.1f s): %s", clock() - started, plan.describe())
    return plan, measured


def tune_runner(runner: Any, max_tokens: int) -> dict[int | str, dict[str, float]]:
    """Tune a ModelRunner over the runtime's compact modules: time its decode steps of up to
    `max_tokens` sequences, and a prompt, under each thread count and product form, and run with the
    fastest plan; oneDNN's packed weights are kept only where the plan uses them, and replace the
    unpacked ones where it uses nothing else. The times measured, in ms."""
    model = runner.model
    forms = (LINEAR, TRANSPOSED, ONEDNN) if model.pack_weights() else (LINEAR, TRANSPOSED)

    def timed(run: Callable[[int], object]) -> Callable[[StepPlan, int], float]:
        def seconds(plan: StepPlan, tokens: int) -> float:
            runner.set_plan(plan)
            started = time.perf_counter()
            run(tokens)
            return time.perf_counter() - started

        return seconds

    pool = runner.plan.pool
    try:
        plan, measured = tune(timed(runner.time_decode), timed(runner.time_prompt), pool, max_tokens, forms)
    finally:  # torch's own count stays the pool's, for whatever else runs forward passes
        runner.set_plan(StepPlan.default(pool))
        torch.set_num_threads(pool)
    if not plan.uses(ONEDNN):
        model.unpack_weights()
    elif plan.only(ONEDNN):
        freed = model.drop_unpacked_weights()
        log.info(
            "Step tuning: every step runs on oneDNN's packed weights; %.0f MiB of unpacked ones freed", freed / 2**20
        )
    runner.set_plan(plan)
    return measured
