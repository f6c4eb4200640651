"""The sampler's batched penalties equal a per-token reference loop, row by row; its argmax is torch's."""

from collections import Counter

import pytest
import torch

from goodput_runtime.engine.sampler import Sampler, SampleRow, row_argmax
from goodput_runtime.sampling import SamplingParams

VOCAB = 50
EOS = 3


def reference(row: torch.Tensor, r: SampleRow, stop: set[int]) -> torch.Tensor:
    x = row.clone()
    p = r.params
    prompt, output = r.token_ids[: r.num_prompt_tokens], r.token_ids[r.num_prompt_tokens :]
    for token, bias in p.logit_bias:
        x[token] += max(-100.0, min(100.0, bias))
    if len(output) < p.min_tokens:
        for token in stop | set(p.stop_token_ids):
            x[token] = float("-inf")
    for token in set(prompt) | set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token, count in Counter(output).items():
        x[token] -= p.frequency_penalty * count + p.presence_penalty
    return x


def test_batched_penalties_equal_the_reference_for_every_row():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=gen) * 3
    rows = [
        SampleRow(SamplingParams(), ("a", 0), [1, 2, 3, 4], 2),
        SampleRow(SamplingParams(repetition_penalty=1.5), ("b", 0), [5, 6, 7, 7, 8], 3),
        SampleRow(SamplingParams(presence_penalty=0.5, frequency_penalty=-0.7), ("c", 0), [9, 10, 11, 11, 11, 12], 2),
        SampleRow(
            SamplingParams(logit_bias=((4, 250.0), (8, -3.0)), min_tokens=3, stop_token_ids=(20,)),
            ("d", 0),
            [1, 2, 3],
            2,
        ),
        SampleRow(
            SamplingParams(
                repetition_penalty=0.8, presence_penalty=1.0, frequency_penalty=1.0, ignore_eos=True, min_tokens=9
            ),
            ("e", 0),
            [13, 14, 13, 15, 3, 3],
            1,
        ),
    ]
    got = Sampler(eos_token_ids=frozenset({EOS})).process(logits, rows)
    for i, r in enumerate(rows):
        stop = set() if r.params.ignore_eos else {EOS}
        want = reference(logits[i], r, stop)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        finite = ~torch.isinf(want)
        assert got[i][finite] == pytest.approx(want[finite], abs=1e-5), i
    assert torch.equal(got[0], logits[0])  # a row without settings is left exactly as it was
    assert got[3, EOS] == float("-inf") and got[3, 20] == float("-inf") and got[3, 4] == logits[3, 4] + 100
    assert got[4, EOS] != float("-inf")  # ignore_eos: EOS is not held off


def test_seeded_rows_draw_the_same_tokens_whatever_else_is_in_the_batch():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    seeded = SampleRow(SamplingParams(temperature=0.9, seed=77, top_k=20, top_p=0.9, min_p=0.05), ("s", 0), [1], 1)
    others = [SampleRow(SamplingParams(temperature=1.2), (f"o{i}", 0), [1], 1) for i in range(3)]
    alone = [Sampler().sample(logits[:1], [seeded])[0][0] for _ in range(3)]
    mixed = [Sampler(seed=s).sample(logits, [seeded, *others])[0][0] for s in range(3)]
    assert mixed == alone
    draws = {
        Sampler().sample(logits[:1], [SampleRow(SamplingParams(temperature=1.0, seed=s), ("x", 0), [1], 1)])[0][0]
        for s in range(30)
    }
    assert len(draws) > 5  # different seeds, different tokens


def test_top_k_top_p_and_min_p_keep_only_the_likeliest_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    sampler = Sampler()

    def support(**settings) -> set[int]:
        return {
            sampler.sample(logits, [SampleRow(SamplingParams(temperature=1.0, **settings), ("k", 0), [1], 1)])[0][0]
            for _ in range(300)
        }

    assert support(top_k=2) == {0, 1}
    assert support(top_p=0.5) == {0}  # the likeliest token holds 0.64 of the mass
    assert support(min_p=0.3) == {0, 1}  # exp(-1) = 0.37 of the likeliest survives, exp(-2) does not
    assert len(support()) >= 4  # unrestricted, the unlikely tokens come up too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_row_argmax_is_torchs_with_ties_and_infinities(dtype):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 49152, generator=g).to(dtype)
    scores[1, 7] = scores[1, 40000] = 50.0  # a tie: the first one
    scores[2] = float("-inf")  # every token ruled out: the first
    scores[2, 31] = float("-inf")
    scores[3, 123] = float("inf")
    scores[4, :10] = 1e4  # ties at the start
    ours = row_argmax(scores)
    assert ours.dtype == torch.int64
    assert ours.tolist() == scores.argmax(dim=-1).tolist()
    assert ours[1] == 7 and ours[2] == 0 and ours[3] == 123 and ours[4] == 0
