"""Decode steps over static, padded buffers (the CUDA-graph path) give the same tokens as eager steps.

On CPU the static path runs without capture, so its padding, scratch block and bucketing are
checked here on every machine; the tests marked `gpu` capture and replay real CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_greedy import BYTES_PER_TOKEN, reference, run_all, small_config, workload

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.engine.decode_graphs import batch_buckets, width_buckets
from goodput_runtime.layers import attention
from goodput_runtime.metrics import RuntimeMetrics


def test_buckets_cover_every_batch_and_context_with_few_shapes():
    sizes = batch_buckets(128)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 128 and sizes == sorted(set(sizes))
    assert len(sizes) <= 12
    for n in range(2, 129):  # every batch has a bucket that less than doubles it
        b = next(s for s in sizes if s >= n)
        assert b < 2 * n
    assert batch_buckets(1000)[-1] == 256  # wider batches run eagerly
    assert batch_buckets(3) == [1, 2, 3]
    widths = width_buckets(16, 4000)
    assert widths == [256, 512, 1024, 2048, 4000]
    assert width_buckets(16, 100) == [112]  # whole blocks
    assert all(w % 16 == 0 for w in width_buckets(16, 3000))


def test_static_decode_path_matches_transformers_under_preemption(tiny_model_dir: Path):
    cases = workload(seed=5, n=10)
    metrics = RuntimeMetrics("tiny", None, None)
    core = build_core(small_config(tiny_model_dir), metrics)
    core.runner.enable_decode_graphs(8, 128, capture=False, min_width=16)
    graphs = core.runner.graphs
    assert graphs is not None and graphs.widths == [16, 32, 64, 128]
    produced = run_all(core, cases)
    assert produced == reference(tiny_model_dir, cases)
    assert graphs.replays > 5  # the decode-only steps took the static path
    assert metrics.preemptions._value.get() > 0
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_blocks_read_by_indexing_8_byte_words_equal_index_select(tiny_model_dir: Path, monkeypatch):
    cache = torch.randn(40 * 16, 2, 16, dtype=torch.bfloat16)
    group = attention.DecodeGroup(slice(0, 3), torch.tensor([[5, 2, 39], [0, 0, 0], [7, 8, 1]]), torch.ones(3), 16)
    monkeypatch.setattr(attention, "GATHER", "index_select")
    expected = attention.gather_blocks(cache, group)
    monkeypatch.setattr(attention, "GATHER", "index")  # what CUDA runs
    assert torch.equal(attention.gather_blocks(cache, group), expected)
    assert torch.equal(expected[0, :, 16:32], cache[2 * 16 : 3 * 16].transpose(0, 1))
    cases = workload(seed=7, n=8)
    core = build_core(small_config(tiny_model_dir))
    core.runner.enable_decode_graphs(8, 128, capture=False, min_width=16)
    assert run_all(core, cases) == reference(tiny_model_dir, cases)


def test_static_decode_path_is_skipped_for_shapes_past_the_cache(tiny_model_dir: Path):
    # batch x width beyond what the cache holds would only pad: such steps run eagerly
    core = build_core(small_config(tiny_model_dir, blocks=40))
    core.runner.enable_decode_graphs(8, 128, capture=False, min_width=16)
    graphs = core.runner.graphs
    assert graphs is not None
    assert graphs.shape_for(1, 100) is not None
    assert graphs.shape_for(4, 30) is not None
    assert graphs.shape_for(8, 30) is None  # 8 x 32 > 160 tokens of cache
    assert graphs.shape_for(9, 10) is None  # more rows than the widest bucket
    cases = workload(seed=6, n=6)
    assert run_all(core, cases) == reference(tiny_model_dir, cases)


def gpu_config(model_dir: Path, **settings) -> EngineConfig:
    base = {
        "device": "cuda",
        "dtype": "float32",
        "block_size": 16,
        "max_model_len": 256,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 16,
        "kv_cache_memory": 8000 * BYTES_PER_TOKEN,
    }
    return EngineConfig(model=str(model_dir), **{**base, **settings})


@pytest.mark.gpu
def test_cuda_graphs_are_captured_and_replayed_with_the_eager_tokens(tiny_model_dir: Path):
    cases = workload(seed=7, n=12)
    graphed = build_core(gpu_config(tiny_model_dir))
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.graphs, "no CUDA graph was captured"
    with_graphs = run_all(graphed, cases)
    assert graphs.replays > 20
    eager = build_core(gpu_config(tiny_model_dir, enforce_eager=True))
    assert eager.runner.graphs is None
    assert with_graphs == run_all(eager, cases)


@pytest.mark.gpu
def test_compiled_layers_replayed_from_cuda_graphs_give_the_eager_tokens(tiny_model_dir: Path):
    cases = workload(seed=9, n=10)
    compiled = build_core(gpu_config(tiny_model_dir, compile=True))
    assert compiled.runner.model.model.compiled is not None  # inductor's kernels, under the graphs
    assert compiled.runner.graphs is not None and compiled.runner.graphs.graphs
    eager = build_core(gpu_config(tiny_model_dir, enforce_eager=True))
    assert run_all(compiled, cases) == run_all(eager, cases)


@pytest.mark.gpu
def test_cuda_graph_logits_equal_eager_logits(tiny_model_dir: Path):
    core = build_core(gpu_config(tiny_model_dir))
    prompts = [[5 + i, 40 + i, 90 + 3 * i] * (1 + i) for i in range(5)]
    for i, prompt in enumerate(prompts):
        core.add(str(i), prompt, small_greedy())
    while any(not r.seq.output_token_ids for r in core.requests.values()):
        core.step()  # prefills
    out = core.scheduler.schedule()
    assert all(s.num_tokens == 1 for s in out.scheduled)
    from goodput_runtime.engine.step import plan_step

    _, items = plan_step(out)
    static = core.runner._decode_static(items)
    eager = core.runner.execute(items)
    assert static is not None
    torch.testing.assert_close(static, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_kv_cache_is_sized_from_the_driver_free_memory(tiny_model_dir: Path):
    total = torch.cuda.mem_get_info()[1]
    core = build_core(gpu_config(tiny_model_dir, kv_cache_memory=None, gpu_memory_utilization=0.3))
    cache = core.runner.cache
    cache_bytes = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
    assert 0.15 * total < cache_bytes <= 0.3 * total


def prefill_logits(core, prompts: list[list[int]]) -> torch.Tensor:
    """[len(prompts), V] float32: the logits after each whole prompt, prefilled into a fresh cache."""
    from goodput_runtime.engine.step import StepItem

    return torch.cat([core.runner.execute([StepItem(p, 0, list(range(-(-len(p) // 16))), True)]) for p in prompts])


@pytest.mark.gpu
def test_fp8_weights_decode_close_to_full_precision(tiny_model_dir: Path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    prompts = [prompt for prompt, _ in workload(seed=8, n=8)]
    full_core = build_core(gpu_config(tiny_model_dir, dtype="bfloat16"))
    fp8_core = build_core(gpu_config(tiny_model_dir, dtype="bfloat16", quantization="fp8"))
    from goodput_runtime.layers.quantization import QuantizedLinear

    assert any(
        isinstance(m, QuantizedLinear) and m.weight.dtype == torch.float8_e4m3fn
        for m in fp8_core.runner.model.modules()
    )
    full, fp8 = prefill_logits(full_core, prompts), prefill_logits(fp8_core, prompts)
    # e4m3 keeps 3 mantissa bits (weights and per-token activations): a few per cent off, not more;
    # a wrong scale or layout would be off by the logits' whole size
    error = ((fp8 - full).norm(dim=-1) / full.norm(dim=-1)).max().item()
    assert error < 0.15, f"fp8 logits are {error:.1%} off the bf16 ones"
    assert (fp8.argmax(-1) == full.argmax(-1)).sum() >= len(prompts) // 2
    # and it decodes through its CUDA graphs: every request to its length
    cases = workload(seed=8, n=6)
    assert [len(t) for t in run_all(fp8_core, cases)] == [n for _, n in cases]
    assert fp8_core.runner.graphs is not None and fp8_core.runner.graphs.replays > 0


def small_greedy():
    from goodput_runtime.sampling import SamplingParams

    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
