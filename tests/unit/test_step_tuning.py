"""Step tuning's choice: per step size, the threads and product form that timed fastest, kept only
where they beat the default by the margin; sizes between timed counts run as the smaller one."""

from __future__ import annotations

import pytest

from goodput_runtime.engine.step_tuning import COUNTS, MARGIN, StepPlan, tune


def fake_machine(costs):
    """step_seconds for tune(): costs(threads, transposed, tokens) in seconds, and the runs it saw."""
    runs: list[tuple[int, bool, int]] = []

    def step_seconds(plan: StepPlan, tokens: int) -> float:
        threads, transposed = plan.threads_for(tokens), plan.layers_transposed_for(tokens)
        assert plan.head_transposed_for(tokens) == transposed
        runs.append((threads, transposed, tokens))
        return costs(threads, transposed, tokens)

    return step_seconds, runs


def this_machine(threads: int, transposed: bool, tokens: int) -> float:
    """Shaped like the project's 2-vCPU machine on SmolLM2: one thread wins small steps, W @ x^T wins
    2 to 32 tokens, two threads win from 4 tokens on."""
    linear = {1: 55, 2: 99, 3: 118, 4: 85, 6: 91, 8: 99, 16: 106, 32: 171, 64: 226}[tokens]
    base = linear * 0.6 if transposed and 2 <= tokens <= 32 else linear
    if threads == 1:
        base *= 0.9 if tokens < 4 else 1.3
    return base / 1000


def test_each_size_runs_with_what_timed_fastest_and_larger_steps_keep_the_default():
    step_seconds, runs = fake_machine(this_machine)
    plan, measured = tune(step_seconds, pool=2, max_tokens=128)
    assert sorted(measured) == list(COUNTS)
    assert measured[2] == {"2": 99.0, "2T": 59.4, "1": 89.1, "1T": 53.46}
    assert (plan.threads_for(1), plan.layers_transposed_for(1)) == (1, False)
    assert (plan.threads_for(2), plan.layers_transposed_for(2)) == (1, True)
    assert (plan.threads_for(3), plan.layers_transposed_for(3)) == (1, True)
    assert (plan.threads_for(5), plan.layers_transposed_for(5)) == (2, True)  # between 4 and 6: as 4
    assert (plan.threads_for(40), plan.layers_transposed_for(40)) == (2, True)  # as 32
    assert (plan.threads_for(64), plan.layers_transposed_for(64)) == (2, False)
    assert (plan.threads_for(65), plan.layers_transposed_for(65)) == (2, False)  # past the timed sizes
    assert (plan.threads_for(512), plan.head_transposed_for(512)) == (2, False)  # a prefill chunk
    assert plan.counts == (1, 2, 4, 64)  # equal neighbours merge
    assert "2-3: 1 thread, W@x^T" in plan.describe()
    # every combination timed at every size, in turns: each one untimed once, then in rounds
    assert len(runs) == len(COUNTS) * 4 * 3
    assert runs[4:8] == [(2, False, 1), (2, True, 1), (1, False, 1), (1, True, 1)]


def test_a_gain_inside_the_margin_keeps_the_default():
    def nearly_equal(threads: int, transposed: bool, tokens: int) -> float:
        return 0.1 * (1 - MARGIN / 2) if (threads, transposed) == (1, True) else 0.1

    plan, _ = tune(fake_machine(nearly_equal)[0], pool=4, max_tokens=16)
    assert all(plan.threads_for(n) == 4 and not plan.layers_transposed_for(n) for n in range(1, 65))
    assert plan.limit == 16


def test_one_thread_times_only_the_two_product_forms():
    step_seconds, runs = fake_machine(lambda threads, transposed, tokens: 0.05 if transposed else 0.1)
    plan, measured = tune(step_seconds, pool=1, max_tokens=8)
    assert {threads for threads, _, _ in runs} == {1}
    assert set(measured[1]) == {"1", "1T"}
    assert max(tokens for _, _, tokens in runs) == 8
    assert plan.layers_transposed_for(8) and not plan.layers_transposed_for(9)


@pytest.mark.parametrize("rows, transposed", [(1, False), (2, True), (8, True), (9, False), (64, False)])
def test_untimed_only_a_verification_steps_lm_head_is_transposed(rows, transposed):
    plan = StepPlan.default(pool=2)
    assert plan.head_transposed_for(rows) is transposed
    assert not plan.layers_transposed_for(rows)
    assert plan.threads_for(rows) == 2
