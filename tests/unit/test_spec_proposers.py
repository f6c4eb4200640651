"""Prompt lookup, the switch's threshold, and the scheduler's rollback of rejected proposals: pure Python."""

from __future__ import annotations

from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.scheduler import Scheduler
from goodput_runtime.engine.sequence import Sequence
from goodput_runtime.engine.spec_decode import can_speculate
from goodput_runtime.engine.spec_decode.ngram import propose_ngram
from goodput_runtime.engine.spec_decode.switch import SpeculationSwitch, expected_tokens, measure_max_batch
from goodput_runtime.sampling import SamplingParams


def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # the suffix [1, 2, 3] occurs at the start: what followed it there
    assert propose_ngram(tokens, k=3, n_min=1, n_max=3) == [4, 5, 9]
    # with suffixes of at most two tokens, [2, 3] last occurred before 7, 8
    assert propose_ngram(tokens, k=2, n_min=1, n_max=2) == [7, 8]
    # a continuation is cut at the end of the tokens
    assert propose_ngram([5, 6, 5], k=4, n_min=1, n_max=2) == [6, 5]
    assert propose_ngram([1, 2, 3], k=3, n_min=1, n_max=3) == []
    assert propose_ngram([1, 2, 3, 4, 3], k=3, n_min=2, n_max=3) == []  # only a one-token match


def test_requests_that_cannot_speculate_are_left_alone():
    seq = Sequence.new("r", [1, 2], SamplingParams(), 0.0)
    assert can_speculate(SamplingParams(), seq)
    assert not can_speculate(SamplingParams(logprobs=2), seq)
    assert not can_speculate(SamplingParams(repetition_penalty=1.2), seq)
    assert not can_speculate(SamplingParams(min_tokens=3), seq)

    class Constrained:
        grammar = object()

    assert not can_speculate(SamplingParams(), Constrained())


def test_the_threshold_is_the_largest_batch_where_verification_costs_less_than_it_yields():
    # a verification of k + 1 tokens costs like a step of (k + 1) * batch tokens, and a step of t tokens
    # costs 10 + t: cheap at batch 1, close to k + 1 times as dear at batch 64
    def seconds(batch: int, tokens: int) -> float:
        return 10 + batch * tokens

    best, ratios = measure_max_batch(seconds, k=3, max_num_seqs=64)
    break_even = expected_tokens(3)
    assert ratios[best] < break_even
    assert ratios[best * 2] >= break_even
    assert best == 4  # (10 + 16) / (10 + 4) = 1.86 < 1.875; (10 + 32) / (10 + 8) = 2.33
    # never gains: never speculates; gains at every batch timed: up to --max-num-seqs
    assert measure_max_batch(lambda b, t: float(t), 3, 16)[0] == 0
    assert measure_max_batch(lambda b, t: 1.0, 3, 256)[0] == 256


def test_the_switch_turns_speculation_off_above_its_threshold():
    switch = SpeculationSwitch(4)
    assert [switch.decide(n) for n in (1, 4, 5, 12, 3, 0)] == [True, True, False, False, True, False]


def scheduler(blocks: int = 16, prefix_caching: bool = True) -> Scheduler:
    scheduler = Scheduler(
        BlockManager(blocks, 4, prefix_caching), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64
    )
    scheduler.switch = SpeculationSwitch(4)
    return scheduler


def decode_once(s: Scheduler, seq: Sequence, token: int, proposal: list[int] | None = None) -> None:
    out = s.schedule()
    assert [item.seq for item in out.scheduled] == [seq]
    s.update(out, [token], proposals={0: proposal} if proposal else None)


def test_rejected_proposals_give_their_blocks_back_and_never_reach_the_prefix_cache():
    s = scheduler()
    bm = s.block_manager
    seq = Sequence.new("r", list(range(10, 16)), SamplingParams(max_tokens=20, temperature=0.0), 0.0)
    s.add(seq)
    decode_once(s, seq, 16, proposal=[17, 18, 19, 20, 21])  # prefill: 6 tokens computed, 7 known
    free_before = bm.num_free_blocks
    out = s.schedule()
    item = out.scheduled[0]
    assert item.draft == [17, 18, 19, 20, 21] and item.num_tokens == 6
    assert len(seq.block_table) == 3  # room for 12 tokens: the 6 computed and 6 verified
    # the target keeps two proposals and samples 99 after them
    s.update(out, [99], accepted={0: [17, 18]})
    assert seq.token_ids == [*range(10, 16), 16, 17, 18, 99]
    assert seq.num_computed_tokens == 9  # the last token, 99, is computed by the next step
    assert len(seq.block_table) == 3 and bm.num_free_blocks == free_before - 1
    # blocks hold only real tokens: the two full ones are hashed with the tokens that stayed
    assert [bm.blocks[b].tokens for b in seq.block_table[:2]] == [(10, 11, 12, 13), (14, 15, 16, 17)]
    assert len(seq.block_hashes) == 2
    # a full rejection gives back every block past the computed tokens
    s.drafts[seq] = [1, 2, 3, 4, 5, 6, 7]
    out = s.schedule()
    assert len(seq.block_table) == 5
    s.update(out, [42], accepted={0: []})
    assert seq.num_computed_tokens == 10 and len(seq.block_table) == 3
    assert seq.token_ids[-2:] == [99, 42]


def test_a_proposal_is_cut_to_the_requests_max_tokens_and_stops_at_its_stop_token():
    s = scheduler()
    params = SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=(18,))
    seq = Sequence.new("r", [1, 2, 3], params, 0.0)
    s.add(seq)
    decode_once(s, seq, 16, proposal=[17, 18, 19, 20])
    out = s.schedule()
    assert out.scheduled[0].draft == [17, 18]  # 1 token out, 3 to go: two proposals and the target's own
    advanced = s.update(out, [19], accepted={0: [17, 18]})
    assert advanced == [seq] and seq.is_finished and seq.finish_reason == "stop"
    assert seq.output_token_ids == [16, 17, 18]  # nothing after the stop token
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_no_proposal_is_verified_while_the_switch_is_off():
    s = scheduler()
    s.switch = SpeculationSwitch(0)
    seq = Sequence.new("r", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0.0), 0.0)
    s.add(seq)
    decode_once(s, seq, 16)
    s.drafts[seq] = [5, 6]
    out = s.schedule()
    assert not out.speculative and out.scheduled[0].draft == [] and out.scheduled[0].num_tokens == 1
