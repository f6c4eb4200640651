"""Embedding requests in the scheduler: prefilled in chunks beside generation, never sampled, finished
with their blocks freed when the prompt is complete; mean pooling never reuses the prefix cache."""

from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.scheduler import Scheduler
from goodput_runtime.engine.sequence import PoolingParams, SeqStatus, Sequence
from goodput_runtime.sampling import SamplingParams


def make(budget=8, num_blocks=64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4), 8, budget, 256, frozenset({2}))


def embedding(rid: str, prompt: list[int], mode: str) -> Sequence:
    seq = Sequence.new(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), 0.0)
    seq.pooling = PoolingParams(mode)
    return seq


def step(s: Scheduler):
    out = s.schedule()
    ends = [item.samples for item in out.scheduled]  # the step reaches the prompt's (or output's) end
    # a stand-in model: every sampling position gets token 7; embedding requests never sample
    advanced = s.update(
        out, [7 if end and item.seq.pooling is None else None for item, end in zip(out.scheduled, ends, strict=True)]
    )
    return out, advanced, ends


def test_an_embedding_is_chunked_beside_a_generation_and_finishes_at_its_prompt_end():
    s = make(budget=8)
    gen = Sequence.new("gen", list(range(10, 14)), SamplingParams(max_tokens=5, temperature=0.0), 0.0)
    emb = embedding("emb", list(range(20, 38)), "last")
    s.add(gen)
    s.add(emb)
    out, advanced, ends = step(s)
    assert [(i.seq.request_id, i.num_tokens) for i in out.scheduled] == [("gen", 4), ("emb", 4)]
    assert advanced == [gen]  # the embedding's prompt is not complete yet
    out, advanced, ends = step(s)
    assert [(i.seq.request_id, i.num_tokens) for i in out.scheduled] == [("gen", 1), ("emb", 7)]
    out, advanced, ends = step(s)
    assert [(i.seq.request_id, i.num_tokens) for i in out.scheduled] == [("gen", 1), ("emb", 7)]
    assert ends == [True, True]  # the embedding's last chunk: the runner pools here
    assert emb in advanced
    assert emb.status is SeqStatus.FINISHED and emb.num_output_tokens == 0
    assert emb.block_table == [] and s.running == [gen]


def test_mean_pooling_computes_every_position_last_token_may_reuse_the_cache():
    s = make(budget=64)
    prompt = list(range(50, 70))
    first = embedding("first", prompt, "last")
    s.add(first)
    step(s)
    assert first.is_finished
    last = embedding("last", prompt, "last")
    mean = embedding("mean", prompt, "mean")
    s.add(last)
    s.add(mean)
    out, _, _ = step(s)
    computed = {i.seq.request_id: i.num_tokens for i in out.scheduled}
    assert computed["last"] < len(prompt)  # its cached blocks were reused; its last token is computed
    assert computed["mean"] == len(prompt)
    assert out.prefix_hit_tokens == len(prompt) - computed["last"]
