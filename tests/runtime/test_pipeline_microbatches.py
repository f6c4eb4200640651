"""How a pipeline step is cut into micro-batches (engine/pipeline_schedule.split), and the flag.

Decodes and prompt chunks are cut into parts of about equal token counts, in the step's order; a
prompt chunk may be cut inside (each part keeps at least two tokens, only the last samples), an
embedding prompt never is; the LM head's rows come back in the whole step's order.
"""

from __future__ import annotations

import pytest

from goodput_runtime.__main__ import parse_args
from goodput_runtime.engine.pipeline_schedule import split
from goodput_runtime.engine.step import StepItem


def items(*lengths: int, prompt_logprobs: bool = False) -> list[StepItem]:
    """Decodes (length 1) and prompt chunks of these lengths, in plan_step's order."""
    out = []
    for i, n in enumerate(lengths):
        start = 20 - i if n == 1 else 3
        count = n - 1 if prompt_logprobs and n > 1 else 0
        out.append(StepItem(list(range(n)), start, list(range(12)), True, prompt_first=0, prompt_count=count))
    return out


def kept(step: list[StepItem]) -> list[int]:
    rows, row = [], 0
    for item in step:
        row += len(item.token_ids)
        rows.extend(item.kept_rows(row - 1))
    return rows


@pytest.mark.parametrize(
    ("lengths", "microbatches", "sizes"),
    [
        ((1,) * 16, 2, [8, 8]),  # steady decode at batch 16
        ((1,) * 16, 4, [4, 4, 4, 4]),
        ((1,) * 5, 2, [2, 3]),
        ((1,), 4, [1]),  # fewer sequences than micro-batches: fewer micro-batches
        ((1, 1, 1), 4, [1, 1, 1]),
        ((24,), 2, [12, 12]),  # one prompt chunk, cut in two
        ((1,) * 4 + (20,), 2, [12, 12]),  # decodes, and a prompt chunk cut where the shares meet
        ((3,), 2, [3]),  # too short to cut: each part keeps at least two tokens
        ((1,) * 3, 1, [3]),
    ],
)
def test_a_step_splits_into_balanced_micro_batches_in_order(lengths, microbatches, sizes):
    step = items(*lengths, prompt_logprobs=True)
    batches = split(step, microbatches)
    assert [sum(len(item.token_ids) for _, item in batch) for batch in batches] == sizes
    flat = [item for batch in batches for _, item in batch]
    assert [index for batch in batches for index, _ in batch] == sorted(
        index for batch in batches for index, _ in batch
    )
    assert [t for item in flat for t in item.token_ids] == [t for item in step for t in item.token_ids]
    assert kept(flat) == kept(step)  # the LM head's rows come back in the whole step's order
    for index, item in (pair for batch in batches for pair in batch):
        whole = step[index]
        assert item.samples == (whole.samples and item.context_len == whole.context_len)  # the last part samples


def test_an_embedding_prompt_is_never_cut():
    step = [StepItem(list(range(30)), 0, list(range(12)), False, pool="mean")]
    assert len(split(step, 4)) == 1


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_micro_batch_count_is_refused_by_name(value, capsys):
    with pytest.raises(SystemExit) as refused:
        parse_args(["--model", "m", "--pipeline-parallel-size", "2", "--pipeline-microbatches", value])
    assert refused.value.code == 2
    assert "--pipeline-microbatches" in capsys.readouterr().err
