"""Rejection sampling keeps the target model's distribution, measured on a small vocabulary."""

from __future__ import annotations

import torch

from goodput_runtime.engine.sampler import Sampler, SampleRow
from goodput_runtime.engine.spec_decode.rejection import SpecGroup, verify
from goodput_runtime.sampling import SamplingParams

VOCAB = 6
DRAWS = 20000


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target never draws was kept"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_tokens_kept_after_a_proposal_follow_the_target_distribution():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 1.5  # rows 0 and 1 judge the two proposed tokens, row 2 the one after
    params = SamplingParams(temperature=0.7, top_k=5)
    target = Sampler.probabilities(logits / 0.7, [params] * 3)
    target = target / target.sum(dim=-1, keepdim=True)
    draft = [int(target[0].argmax()), int(target[1].argmin())]  # one likely, one the target never keeps
    sampler = Sampler(seed=1)
    row = SampleRow(params, ("r", 0), [1, 2], 2)
    firsts, seconds = torch.zeros(VOCAB), torch.zeros(VOCAB)
    lengths = torch.zeros(3)
    batch = 500  # verifications per call: each group reads the same three rows
    for _ in range(DRAWS // batch):
        for kept in verify(logits, [SpecGroup(0, draft, row)] * batch, sampler):
            lengths[len(kept) - 1] += 1
            firsts[kept[0]] += 1
            if len(kept) > 1:
                seconds[kept[1]] += 1
    # the first token is distributed as the target's first row, whatever was proposed
    assert chi_square(firsts, target[0]) < 20.5  # chi-square, 5 degrees of freedom, p = 0.001
    # the first proposal is accepted as often as the target draws it
    assert abs(lengths[1:].sum() / DRAWS - target[0, draft[0]]) < 0.02
    # the second token (after an accepted first) is distributed as the second row; the proposal
    # the target gives no mass (top-k cut it) is never kept
    assert chi_square(seconds, target[1]) < 20.5
    assert lengths[2] == 0


def test_greedy_requests_keep_the_longest_prefix_equal_to_the_argmax():
    logits = torch.full((4, VOCAB), -1.0)
    for row, best in enumerate([3, 1, 4, 2]):
        logits[row, best] = 5.0
    row = SampleRow(SamplingParams(temperature=0.0), ("g", 0), [1], 1)
    sampler = Sampler()
    assert verify(logits, [SpecGroup(0, [3, 1, 4], row)], sampler) == [[3, 1, 4, 2]]
    assert verify(logits, [SpecGroup(0, [3, 5, 4], row)], sampler) == [[3, 1]]
    assert verify(logits, [SpecGroup(0, [0, 1, 4], row)], sampler) == [[3]]
    # two groups in one step: each reads its own rows
    assert verify(logits, [SpecGroup(0, [3], row), SpecGroup(2, [2], row)], sampler) == [[3, 1], [4]]


def test_seeded_requests_repeat_their_verifications():
    logits = torch.randn(4, VOCAB)
    params = SamplingParams(temperature=1.0, seed=7)
    row = SampleRow(params, ("s", 0), [1], 1)
    runs = []
    for _ in range(2):
        sampler = Sampler(seed=123)
        runs.append([verify(logits, [SpecGroup(0, [0, 1, 2], row)], sampler)[0] for _ in range(20)])
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) > 1
