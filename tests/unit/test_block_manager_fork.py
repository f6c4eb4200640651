"""Choices forked from one prefill share its blocks; a partly filled block is copied on write."""

from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.sequence import Sequence
from goodput_runtime.sampling import SamplingParams


def forked(bm: BlockManager, prompt_len: int, n: int) -> list[Sequence]:
    """A prompt computed by one sequence, then n - 1 forks of it, each with one sampled token."""
    prompt = list(range(prompt_len))
    parent = Sequence.new("r", prompt, SamplingParams(n=n), 0.0)
    assert bm.allocate(parent, prompt_len)
    parent.num_computed_tokens = prompt_len
    bm.commit(parent)
    children = [Sequence.new("r", prompt, parent.params, 0.0, parent.times, index=i) for i in range(1, n)]
    for child in children:
        bm.fork(parent, child)
    for i, s in enumerate([parent, *children]):
        s.token_ids.append(500 + i)
    return [parent, *children]


def test_forks_take_no_new_blocks_until_they_write():
    bm = BlockManager(num_blocks=16, block_size=4)
    seqs = forked(bm, 10, 4)  # two full blocks and one holding two tokens
    assert bm.num_free_blocks == 13
    assert all(s.block_table == seqs[0].block_table for s in seqs)
    assert [bm.blocks[b].ref_count for b in seqs[0].block_table] == [4, 4, 4]


def test_the_shared_partial_block_is_copied_by_every_writer_but_the_last():
    bm = BlockManager(num_blocks=16, block_size=4)
    seqs = forked(bm, 10, 3)
    partial = seqs[0].block_table[2]
    for s in seqs:
        assert bm.allocate(s, 1)
    copies = [s.block_copies for s in seqs]
    assert copies[0] and copies[1] and not copies[2]  # the last holder writes in place
    for s, c in zip(seqs[:2], copies[:2], strict=True):
        [(source, target)] = c
        assert source == partial and s.block_table[2] == target != partial
    assert seqs[2].block_table[2] == partial and bm.blocks[partial].ref_count == 1
    assert len({s.block_table[2] for s in seqs}) == 3
    assert seqs[0].block_table[:2] == seqs[1].block_table[:2] == seqs[2].block_table[:2]
    for s in seqs:
        bm.free_seq(s)
    assert bm.num_free_blocks == 16


def test_a_copy_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    seqs = forked(bm, 10, 2)
    assert bm.num_free_blocks == 0
    assert not bm.allocate(seqs[0], 1)
    assert seqs[0].block_copies == [] and bm.blocks[seqs[0].block_table[2]].ref_count == 2
    bm.free_seq(seqs[1])  # a preempted choice gives back only its references
    assert bm.num_free_blocks == 0
    assert bm.allocate(seqs[0], 1) and seqs[0].block_copies == []  # now the only holder: in place


def test_a_prompt_of_whole_blocks_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    seqs = forked(bm, 8, 3)
    for s in seqs:
        assert bm.allocate(s, 1)
        assert s.block_copies == []
    assert len({s.block_table[2] for s in seqs}) == 3
