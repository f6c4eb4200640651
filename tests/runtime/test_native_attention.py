"""The native decode attention kernel (C++, straight over the paged cache) against the torch path
(the blocks gathered, then scaled_dot_product_attention), and the engine's greedy tokens with it
on and off."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine_greedy import run_all, small_config, workload
from test_models import mistral_dir

from goodput_runtime.engine.builder import build_core
from goodput_runtime.layers import attention, native_attention
from goodput_runtime.layers.attention import DecodeGroup, KVCache, PagedBatch
from goodput_runtime.sampling import SamplingParams


def paged_case(
    lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    pad_blocks: int = 2,
) -> tuple[torch.Tensor, KVCache, PagedBatch]:
    """Random queries and cache; each row's context in shuffled blocks, its table padded to the widest
    row plus pad_blocks with blocks holding other rows' data (masked: must not count)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    width = max(need) + pad_blocks
    num_blocks = sum(need) + 4
    cache = KVCache(
        [torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)],
        [torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)],
    )
    order = torch.randperm(num_blocks, generator=g).tolist()
    rows, taken = [], 0
    for n in need:
        own = order[taken : taken + n]
        taken += n
        rows.append(own + [order[(taken + k) % num_blocks] for k in range(width - n)])
    group = DecodeGroup(slice(0, len(lens)), torch.tensor(rows), torch.tensor(lens), block_size)
    batch = PagedBatch(cache, torch.zeros(0, dtype=torch.int64), decodes=[group])
    query = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return query, cache, batch


def both(
    query: torch.Tensor, batch: PagedBatch, window: int | None, scaling: float | None, monkeypatch
) -> tuple[torch.Tensor, torch.Tensor]:
    group, cache = batch.decodes[0], batch.cache
    gqa = query.shape[1] != cache.keys[0].shape[1]
    native = native_attention.decode(
        query, cache.keys[0], cache.values[0], group.blocks, group.lens, group.block_size, scaling, window
    )
    assert native is not None
    monkeypatch.setattr(attention, "DECODE_KERNEL", "torch")
    torch_out = attention.attend_decode(
        query, cache.keys[0], cache.values[0], group, batch.decode_mask(0, window), scaling, gqa, window
    )
    return native, torch_out


SHAPES = [(9, 3, 64), (4, 4, 16), (8, 2, 128), (6, 2, 40)]  # SmolLM2's GQA; plain MHA; wider and odd heads
LENS = [[1], [16], [300], [1, 17, 64, 1000], [5, 33, 2, 250, 16, 1, 90, 7]]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
@pytest.mark.parametrize("lens", LENS, ids=lambda n: "lens-" + "-".join(map(str, n)))
@pytest.mark.parametrize("window", [None, 8, 40])
def test_fp32_matches_the_torch_path(kernel, shape, lens, window, monkeypatch):
    heads, kv_heads, head_dim = shape
    query, _, batch = paged_case(lens, heads, kv_heads, head_dim, 16, torch.float32, seed=sum(lens) + heads)
    native, expected = both(query, batch, window, None, monkeypatch)
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 8, 32])
def test_fp32_block_sizes_and_a_given_scale(kernel, block_size, monkeypatch):
    query, _, batch = paged_case([1, 3, 31, 100, 129], 9, 3, 64, block_size, torch.float32, seed=block_size)
    native, expected = both(query, batch, None, 0.37, monkeypatch)
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 4, 16)], ids=["gqa", "mha"])
@pytest.mark.parametrize("window", [None, 24])
def test_bf16_matches_the_torch_path(kernel, shape, window, monkeypatch):
    # fp32 accumulation here against bf16 arithmetic inside SDPA: within bf16's own rounding
    heads, kv_heads, head_dim = shape
    query, _, batch = paged_case([1, 16, 70, 300], heads, kv_heads, head_dim, 16, torch.bfloat16, seed=3)
    native, expected = both(query, batch, window, None, monkeypatch)
    assert native.dtype == torch.bfloat16
    reference = both(
        query.float(),
        PagedBatch(
            KVCache([batch.cache.keys[0].float()], [batch.cache.values[0].float()]),
            batch.slot_mapping,
            decodes=batch.decodes,
        ),
        window,
        None,
        monkeypatch,
    )[1]
    torch.testing.assert_close(native.float(), reference, rtol=0.02, atol=0.02)
    torch.testing.assert_close(native.float(), expected.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("fold", ["avx2", "scalar"])
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 4, 16), (8, 2, 128)], ids=["gqa", "mha-d16", "d128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_narrower_fold_matches_the_torch_path(kernel, fold, shape, dtype, monkeypatch):
    """The fold the CPU's widest vectors would not take (GOODPUT_DECODE_FOLD): the AVX2 one is the one an
    AVX2-only CPU runs, checked here on a CPU with AVX-512 too."""
    from goodput_runtime.layers import cpu_dtype

    if fold == "avx2" and not {"avx2", "fma"} <= cpu_dtype.cpu_flags():
        pytest.skip("this CPU has no AVX2 and FMA")
    heads, kv_heads, head_dim = shape
    monkeypatch.setenv("GOODPUT_DECODE_FOLD", fold)
    for lens, window in (([1, 17, 64, 1000], None), ([5, 33, 2, 250, 16, 1, 90, 7], 40)):
        query, _, batch = paged_case(lens, heads, kv_heads, head_dim, 16, dtype, seed=len(lens) + head_dim)
        if dtype == torch.float32:
            native, expected = both(query, batch, window, None, monkeypatch)
            torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)
            continue
        widened = PagedBatch(
            KVCache([batch.cache.keys[0].float()], [batch.cache.values[0].float()]),
            batch.slot_mapping,
            decodes=batch.decodes,
        )
        native = both(query, batch, window, None, monkeypatch)[0]
        reference = both(query.float(), widened, window, None, monkeypatch)[1]
        assert native.dtype == torch.bfloat16
        torch.testing.assert_close(native.float(), reference, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("window", [None, 8, 30])
def test_rows_longer_than_the_group_width_are_masked_as_the_torch_path_masks_them(kernel, window, monkeypatch):
    # a group's width is its first row's context; a later, longer row sees only that much (the engine
    # orders decodes longest first, so it never forms such a group; bench/decode_step.py does)
    query, _, batch = paged_case([100, 90, 40], 9, 3, 64, 16, torch.float32, seed=5)
    group = batch.decodes[0]
    batch.decodes[0] = DecodeGroup(group.rows, group.blocks[:, :5], group.lens, group.block_size)
    native, expected = both(query, batch, window, None, monkeypatch)
    rows = [0, 1, 2] if window != 8 else [2]  # a window past the width leaves nothing: torch's NaN
    torch.testing.assert_close(native[rows], expected[rows], rtol=1e-5, atol=1e-5)


def test_a_strided_query_and_unsupported_dtypes(kernel, monkeypatch):
    # the model hands over queries sliced out of the fused q/k/v projection: not contiguous
    query, cache, batch = paged_case([5, 40], 9, 3, 64, 16, torch.float32, seed=1)
    wide = torch.randn(2, 12, 64)
    wide[:, :9] = query
    native, expected = both(wide[:, :9], batch, None, None, monkeypatch)
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)
    group = batch.decodes[0]
    half = native_attention.decode(
        query.half(), cache.keys[0].half(), cache.values[0].half(), group.blocks, group.lens, 16, None, None
    )
    assert half is None  # the caller takes the torch path


def test_attend_takes_the_kernel_on_cpu_and_the_switch_turns_it_off(kernel, monkeypatch):
    query, cache, batch = paged_case([7, 20], 9, 3, 64, 16, torch.float32, seed=2)
    calls = count_calls(monkeypatch)
    group = batch.decodes[0]
    attention.attend_decode(query, cache.keys[0], cache.values[0], group, batch.decode_mask(0, None), None, True, None)
    assert calls == [1]
    monkeypatch.setattr(attention, "DECODE_KERNEL", "torch")
    attention.attend_decode(query, cache.keys[0], cache.values[0], group, batch.decode_mask(0, None), None, True, None)
    assert calls == [1]


def test_without_a_compiler_decode_says_none_and_attend_takes_the_torch_path(monkeypatch):
    monkeypatch.setattr(native_attention, "_state", {})  # as in a fresh process
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(native_attention.shutil, "which", lambda name: None)
    query, cache, batch = paged_case([7, 20], 9, 3, 64, 16, torch.float32, seed=4)
    group = batch.decodes[0]
    assert not native_attention.available()
    assert (
        native_attention.decode(query, cache.keys[0], cache.values[0], group.blocks, group.lens, 16, None, None) is None
    )
    out = attention.attend_decode(
        query, cache.keys[0], cache.values[0], group, batch.decode_mask(0, None), None, True, None
    )
    monkeypatch.setattr(attention, "DECODE_KERNEL", "torch")
    expected = attention.attend_decode(
        query, cache.keys[0], cache.values[0], group, batch.decode_mask(0, None), None, True, None
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def count_calls(monkeypatch) -> list[int]:
    """A list that grows by one at each call of native_attention.decode."""
    calls: list[int] = []
    real = native_attention.decode

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(native_attention, "decode", counted)
    return calls


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_engine_greedy_tokens_are_the_same_with_the_kernel_on_and_off(
    kernel, arch, tiny_model_dir, tmp_path, monkeypatch
):
    model_dir = tiny_model_dir if arch == "llama" else mistral_dir(tiny_model_dir, tmp_path)
    cases = workload(seed=11, n=10)
    calls = count_calls(monkeypatch)
    with_kernel = run_all(build_core(small_config(model_dir, blocks=200)), cases)
    assert calls  # the decodes went through the kernel
    monkeypatch.setattr(attention, "DECODE_KERNEL", "torch")
    calls.clear()
    without = run_all(build_core(small_config(model_dir, blocks=200)), cases)
    assert not calls
    assert with_kernel == without


def test_a_build_left_locked_by_a_killed_process_does_not_hang_the_next(kernel):
    """torch's build lock is a file only its creator removes; a runtime killed while building (or while
    checking its cached build) leaves it behind. The next process must still load the kernel."""
    import subprocess
    import sys

    folder = native_attention.build_directory(native_attention.build_name())
    (folder / "lock").touch()  # as a process SIGKILLed inside torch's build leaves it
    probe = "from goodput_runtime.layers import native_attention as n; print(n.available())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
    assert not (folder / "lock").exists()


def test_a_step_attends_all_its_decodes_in_one_call_per_layer(kernel, tiny_model_dir, monkeypatch):
    """Contexts of 5, 31 and 81 tokens: the torch path would take them as three groups of similar
    width (sparing itself padding); the kernel, reading each row to its own length, takes them at once."""
    core = build_core(small_config(tiny_model_dir, blocks=200))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    rng = random.Random(5)
    for i, n in enumerate((4, 30, 80)):
        core.add(f"r{i}", [rng.randrange(5, 1000) for _ in range(n)], params)
    while any(s.num_output_tokens == 0 for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    calls = count_calls(monkeypatch)
    core.step()
    assert len(core.scheduler.running) == 3
    assert len(calls) == core.runner.layout.num_layers
