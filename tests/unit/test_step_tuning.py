"""Step tuning's choice: per step size, the threads and product form that timed fastest, kept only
where they beat the default by the margin, oneDNN preferred where it comes close; sizes between timed
counts run as the smaller one, prompts as the form that timed fastest on one."""

from __future__ import annotations

import pytest

from goodput_runtime.engine.step_tuning import COUNTS, MARGIN, PREFER, PREFILL, tune
from goodput_runtime.layers.step_plan import LINEAR, NATIVE, ONEDNN, TRANSPOSED, StepPlan


def fake_machine(costs):
    """step_seconds and prefill_seconds for tune(): costs(threads, form, tokens, prompt) in seconds,
    and the runs they saw."""
    runs: list[tuple[int, str, int]] = []

    def seconds(prompt: bool):
        def run(plan: StepPlan, tokens: int) -> float:
            threads, form = plan.threads_for(tokens), plan.layer_form(tokens)
            assert plan.head_form(tokens) == form
            runs.append((threads, form, tokens))
            return costs(threads, form, tokens, prompt)

        return run

    return seconds(False), seconds(True), runs


def mkl_on_amd(threads: int, form: str, tokens: int, prompt: bool) -> float:
    """MKL's slow path for 2-8 rows, the transposed form fast there, no oneDNN; one thread wins small
    steps, two from 4 tokens on."""
    linear = 400 if prompt else {1: 55, 2: 99, 3: 118, 4: 85, 6: 91, 8: 99, 16: 106, 32: 171, 64: 226}[tokens]
    base = linear * 0.6 if form == TRANSPOSED and 2 <= tokens <= 32 else linear
    if threads == 1:
        base *= 0.9 if tokens < 4 else 1.3
    return base / 1000


def test_each_size_runs_with_what_timed_fastest():
    step, prefill, runs = fake_machine(mkl_on_amd)
    plan, measured = tune(step, prefill, pool=2, max_tokens=128, forms=(LINEAR, TRANSPOSED))
    assert sorted(k for k in measured if k != "prefill") == list(COUNTS)
    assert measured[2] == {"2 linear": 99.0, "2 transposed": 59.4, "1 linear": 89.1, "1 transposed": 53.46}
    assert (plan.threads_for(1), plan.layer_form(1)) == (1, LINEAR)
    assert (plan.threads_for(2), plan.layer_form(2)) == (1, TRANSPOSED)
    assert (plan.threads_for(3), plan.layer_form(3)) == (1, TRANSPOSED)
    assert (plan.threads_for(5), plan.layer_form(5)) == (2, TRANSPOSED)  # between 4 and 6: as 4
    assert (plan.threads_for(40), plan.layer_form(40)) == (2, TRANSPOSED)  # as 32
    assert (plan.threads_for(64), plan.layer_form(64)) == (2, LINEAR)
    assert (plan.threads_for(512), plan.head_form(512)) == (2, LINEAR)  # a prefill chunk
    assert plan.counts == (1, 2, 4, 64)  # equal neighbours merge
    assert "2-3: 1 thread, W@x^T" in plan.describe()
    # in turns: each combination untimed once, then in rounds
    assert runs[4:8] == [(2, LINEAR, 1), (2, TRANSPOSED, 1), (1, LINEAR, 1), (1, TRANSPOSED, 1)]
    # a combination 1.5x slower than the fastest at one count is not timed at the next (the default is)
    assert set(measured[3]) == {"2 linear", "2 transposed", "1 transposed"}
    assert runs[-1] == (2, TRANSPOSED, PREFILL) and set(measured["prefill"]) == {"2 linear", "2 transposed"}


def test_onednn_wins_where_it_comes_close_so_the_plan_can_be_onednn_throughout():
    def close(threads: int, form: str, tokens: int, prompt: bool) -> float:
        return {TRANSPOSED: 0.1, ONEDNN: 0.1 * (1 + PREFER / 2), LINEAR: 0.2, NATIVE: 0.2}[form] / threads

    plan, _ = tune(*fake_machine(close)[:2], pool=2, max_tokens=64)
    assert plan.only(ONEDNN) and plan.uses(ONEDNN)
    assert plan.threads_for(1) == 2 and plan.layer_form(1000) == ONEDNN


def native_then_onednn(threads: int, form: str, tokens: int, prompt: bool) -> float:
    """The AVX2 EPYC's shape (ms, two threads; one thread 1.5x): the native product streams the weights
    at the memory's rate for a few rows and loses past 16; oneDNN gains with the rows."""
    if prompt:
        return {LINEAR: 0.66, TRANSPOSED: 0.68, ONEDNN: 0.52, NATIVE: 5.0}[form]
    ms = {
        LINEAR: 60 + 3 * tokens,
        TRANSPOSED: 60 + 3 * tokens,
        ONEDNN: 45 + 2.4 * tokens,
        NATIVE: 30 + 3.8 * tokens,
    }[form]
    return ms * (1.5 if threads == 1 else 1.0) / 1000


def test_the_native_form_wins_few_rows_and_onednn_takes_over_where_it_overtakes():
    # at one row the native form is 1.7x faster than oneDNN; a form that far behind at one count must
    # still be timed at the next on the pool's threads, or the plan would keep the native form past 16
    step, prefill, runs = fake_machine(native_then_onednn)
    plan, measured = tune(step, prefill, pool=2, max_tokens=64)
    assert (plan.threads_for(1), plan.layer_form(1)) == (2, NATIVE)
    assert plan.layer_form(8) == NATIVE  # 60.4 against 64.2
    assert plan.layer_form(16) == ONEDNN and plan.layer_form(64) == ONEDNN
    assert "2 onednn" in measured[64] and "1 onednn" not in measured[64]
    assert (2, NATIVE, PREFILL) not in runs and plan.layer_form(1000) == ONEDNN  # prompts never time it


def test_a_gain_inside_the_margin_keeps_the_default():
    def nearly_equal(threads: int, form: str, tokens: int, prompt: bool) -> float:
        return 0.1 * (1 - MARGIN / 2) if (threads, form) == (1, TRANSPOSED) else 0.1

    plan, _ = tune(*fake_machine(nearly_equal)[:2], pool=4, max_tokens=16, forms=(LINEAR, TRANSPOSED))
    assert all(plan.threads_for(n) == 4 and plan.layer_form(n) == LINEAR for n in range(1, 65))
    assert plan.limit == 16 and not plan.uses(ONEDNN)


def test_one_thread_times_only_the_forms():
    step, prefill, runs = fake_machine(lambda threads, form, tokens, prompt: 0.05 if form == ONEDNN else 0.1)
    plan, measured = tune(step, prefill, pool=1, max_tokens=8)
    assert {threads for threads, _, _ in runs} == {1}
    assert set(measured[1]) == {"1 linear", "1 transposed", "1 onednn", "1 native"}
    assert max(tokens for _, _, tokens in runs if tokens != PREFILL) == 8
    assert plan.layer_form(8) == plan.layer_form(9) == ONEDNN  # larger steps: the prompt's form


@pytest.mark.parametrize("rows, form", [(1, LINEAR), (2, TRANSPOSED), (8, TRANSPOSED), (9, LINEAR), (64, LINEAR)])
def test_untimed_only_a_verification_steps_lm_head_is_transposed(rows, form):
    plan = StepPlan.default(pool=2)
    assert plan.head_form(rows) == form
    assert plan.layer_form(rows) == LINEAR
    assert plan.threads_for(rows) == 2
