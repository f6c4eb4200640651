"""Prompt lookup's adaptive proposal length and the start-up cost table: pure Python."""

from __future__ import annotations

import pytest

from goodput_runtime.engine.spec_decode.ngram import NgramProposer, best_length, expected_yield, find_ngram
from goodput_runtime.engine.spec_decode.switch import step_costs


def test_expected_yield_counts_the_kept_proposals_and_the_targets_own_token():
    assert expected_yield(0.0, 5) == 1.0
    assert expected_yield(1.0, 3) == 4.0
    assert expected_yield(0.5, 3) == pytest.approx(1.875)


def test_the_best_length_weighs_the_expected_tokens_against_the_step_cost():
    flat = [1.0] * 8  # a verification costs what a decode does: propose all k
    assert best_length(0.6, flat, 7) == 7
    # a CPU: 2 and 3 tokens cost more than 4 (small matrix products take a slow path)
    cpu = [1.0, 1.75, 2.2, 1.3, 1.42, 1.58]
    assert best_length(0.5, cpu, 5) == 3
    assert best_length(0.95, cpu, 5) == 5
    assert best_length(0.1, cpu, 5) == 0  # 1.11 tokens for 1.3 times the step: not worth it
    assert best_length(0.5, cpu, 2) == 0  # only the slow lengths are left


def test_find_ngram_gives_the_longest_match_and_where_its_continuation_starts():
    assert find_ngram([1, 2, 3, 9, 1, 2, 3]) == (3, 3)
    assert find_ngram([1, 2, 3]) == (0, 0)


def test_without_costs_every_match_proposes_up_to_k_tokens():
    proposer = NgramProposer(3, 1, 4)
    assert proposer.propose([(("a", 0), [1, 2, 3, 4, 5, 1, 2])]) == [[3, 4, 5]]


def test_weak_matches_stop_being_proposed_once_they_fail_and_strong_ones_keep_the_full_length():
    costs = [1.0, 1.75, 2.2, 1.3, 1.42, 1.58]
    proposer = NgramProposer(5, 1, 4, costs)
    key = ("r", 0)
    # one-token matches of token 7, whose continuation never comes true: each time 7 comes back, it
    # follows other new tokens than the last time
    tokens = [7, 1, 2, 3, 4, 5, 6, 7]
    lengths = []
    for block in range(8):
        lengths.append(len(proposer.propose([(key, tokens)])[0]))
        for token in range(10 * block + 10, 10 * block + 16):  # new tokens: nothing to match
            tokens = [*tokens, token]
            assert proposer.propose([(key, tokens)]) == [[]]
        tokens = [*tokens, 7]
    assert lengths[0] == 3  # the prior (one in two kept) pays for 3 tokens at these costs
    assert lengths[-1] == 0  # learned: a one-token match is wrong here
    assert proposer.acceptance(key, 1) < 0.3
    # a passage copied: four-token matches come true and propose all 5
    passage = list(range(100, 120))
    copy = [*passage, 0, *passage[:6]]
    for _ in range(3):
        copied = len(copy) - len(passage) - 1
        proposal = proposer.propose([(key, copy)])[0]
        assert proposal == passage[copied : copied + len(proposal)]
        copy = [*copy, *passage[copied : copied + 4]]
    assert len(proposal) == 5
    assert proposer.acceptance(key, 4) > 0.8
    proposer.forget("r")
    assert not proposer.counts and not proposer.pending


def test_sequences_learn_apart_so_a_seeded_request_draws_the_same_whatever_ran_before():
    costs = [1.0, 1.75, 2.2, 1.3, 1.42, 1.58]
    first, second = NgramProposer(5, 1, 4, costs), NgramProposer(5, 1, 4, costs)
    tokens = [7, 1, 7, 2, 7, 3, 7]
    for nxt in (4, 7, 5, 7, 6, 7):
        first.propose([(("other", 0), tokens)])
        tokens = [*tokens, nxt]
    assert first.propose([(("mine", 0), [7, 1, 7])]) == second.propose([(("mine", 0), [7, 1, 7])])


def test_step_costs_time_each_length_in_turns_relative_to_one_token():
    calls = []

    def seconds(batch: int, tokens: int) -> float:
        calls.append((batch, tokens))
        return {1: 2.0, 2: 3.0, 3: 4.0}[tokens] + (0.5 if len(calls) <= 3 else 0.0)  # the first turn is slower

    assert step_costs(seconds, 2) == [1.0, 1.5, 2.0]
    assert calls == [(1, 1), (1, 2), (1, 3)] * 2
