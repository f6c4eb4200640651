"""Step tuning on a CPU: per step size, the thread count and the form of the matrix products
(layers/step_plan.py) that run it fastest, timed at start-up.

A step on a CPU is a chain of matrix products with as many rows as the step has tokens. Which BLAS
kernel runs them fastest, and whether a second thread helps, differ from one machine to the next,
so they are measured here instead of guessed.

For each token count in COUNTS up to the engine's largest decode step, every combination (the pool's
threads or one, each available form) times a decode step of that many sequences, in turns; the fastest
wins where it beats the default (the pool, ``linear``) by more than MARGIN; and where oneDNN comes
within PREFER of the winner at every count and on the prompt, it takes them all: a plan that is oneDNN
throughout needs no unpacked weights, so the packed copy then replaces them instead of doubling the
memory they take (short of that, each count keeps its winner: the unpacked weights stay anyway). A
combination on fewer threads than the pool's that is DROP times slower than the fastest at one count
is not timed at the next; every form keeps being timed on the pool's threads, since the forms' order changes with the
step's size (the native form wins a few rows and loses many; oneDNN the reverse). A step of a size
between two timed counts runs as the smaller one. Larger steps (prefill chunks) run with the pool's
threads and the form that timed fastest on a PREFILL-token prompt (the native form is not timed there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from goodput_runtime.layers import native_attention
from goodput_runtime.layers.step_plan import FORMS, LINEAR, NATIVE, ONEDNN, TRANSPOSED, StepPlan

log = logging.getLogger(__name__)

COUNTS = (1, 2, 3, 4, 6, 8, 16, 32, 64)
PREFILL = 256  # tokens of the prompt that times the form of larger steps
ROUNDS = 2  # timed runs of each combination, in turns, after one untimed
MARGIN = 0.05  # a combination other than the default must be this much faster
PREFER = 0.15  # oneDNN throughout where it comes this close to the fastest everywhere (then packed weights only)
DROP = 1.5  # fewer threads than the pool's, this much slower than the fastest at one count: not timed at the next


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
    ) -> tuple[tuple[int, str], tuple[int, str] | None]:
        """The winner, and the fastest oneDNN combination if it comes within PREFER of it."""
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
        measured[key] = {f"{t} {f}": round(1000 * s, 2) for (t, f), s in zip(choices, best, strict=True)}
        return choices[pick], (choices[min(packed, key=best.__getitem__)] if packed else None)

    measured: dict[int | str, dict[str, float]] = {}
    winners, close = [], []
    candidates = combos
    for count in counts:
        winner, packed = fastest(step_seconds, count, candidates, count, measured)
        winners.append(winner)
        close.append(packed)
        times = measured[count]
        quickest = min(times.values())
        candidates = [c for c in candidates if c[0] == pool or times[f"{c[0]} {c[1]}"] <= DROP * quickest]
    # the native form is a decode step's product (a few rows): never timed on a prompt
    (_, large), packed = fastest(
        prefill_seconds, PREFILL, [(pool, f) for f in forms if f != NATIVE], "prefill", measured
    )
    chosen = winners
    if packed is not None and all(c is not None for c in close):  # oneDNN throughout: its weights replace the rest
        chosen, large = cast(list[tuple[int, str]], close), ONEDNN
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
    forms: tuple[str, ...] = (LINEAR, TRANSPOSED, ONEDNN) if model.pack_weights() else (LINEAR, TRANSPOSED)
    if model.lm_head.weight.dtype == torch.float32 and native_attention.skinny_linear_available():
        forms += (NATIVE,)

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
