"""The CUDA decode attention kernel (Triton, straight over the paged cache, the step's keys and values
stored by the same launch) against the torch path (index_copy_ into the cache, blocks gathered,
scaled_dot_product_attention).

Without a GPU the kernel runs through Triton's interpreter on CPU tensors (TRITON_INTERPRET=1):
the same kernel source, every mask and index, executed by numpy. The tests skip where Triton is not
installed. The `gpu` test runs it compiled, on CUDA, and the engine's greedy tokens with it.
"""

from __future__ import annotations

import pytest
import torch
from graph_replays import replayed
from test_native_attention import paged_case

from goodput_runtime.layers import attention, triton_attention, triton_linear
from goodput_runtime.layers.attention import PagedBatch

pytestmark = pytest.mark.skipif(not triton_attention.importable(), reason="Triton is not installed")


def step_case(
    lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedBatch]:
    """A decode step: queries, the new tokens' keys and values, and a batch whose slot mapping puts
    each new token at its row's last position (within its own blocks)."""
    query, cache, batch = paged_case(lens, heads, kv_heads, head_dim, 16, dtype, seed)
    group = batch.decodes[0]
    g = torch.Generator().manual_seed(seed + 1)
    key = torch.randn(len(lens), kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(len(lens), kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.tensor([int(group.blocks[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(lens)])
    cache.keys[0], cache.values[0] = cache.keys[0].to(device), cache.values[0].to(device)
    group.blocks, group.lens = group.blocks.to(device), group.lens.to(device)
    batch = PagedBatch(cache, slots.to(device), decodes=[group])
    return query.to(device), key.to(device), value.to(device), batch


def torch_path(query, key, value, batch: PagedBatch, window, scaling, monkeypatch):
    """The torch path's output, and its cache after the step (on copies: the batch is left as it was)."""
    cache = batch.cache
    keys, values = cache.keys[0].clone(), cache.values[0].clone()
    copy = PagedBatch(type(cache)([keys], [values]), batch.slot_mapping, decodes=batch.decodes)
    with monkeypatch.context() as patch:
        patch.setattr(attention, "DECODE_KERNEL", "torch")
        out = attention.attend(copy, 0, query, key, value, scaling, window)
    return out, keys, values


SHAPES = [(9, 3, 64), (32, 4, 64), (4, 4, 16), (8, 2, 128), (6, 2, 40)]  # SmolLM2; a 1B Llama; MHA; wide; odd
LENS = [[1], [17], [300], [1, 17, 64, 1000], [5, 33, 2, 250, 16, 1, 90, 7]]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
@pytest.mark.parametrize("lens", LENS, ids=lambda n: "lens-" + "-".join(map(str, n)))
@pytest.mark.parametrize("window", [None, 40])
def test_fused_write_and_attend_equal_the_torch_path(shape, lens, window, interpret, monkeypatch):
    check_fused(shape, lens, window, monkeypatch)


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("lens", [[1000], [300, 1, 17], [1, 2]], ids=lambda n: "lens-" + "-".join(map(str, n)))
@pytest.mark.parametrize("window", [None, 40])
def test_a_context_split_across_programs_gives_the_same_attention(splits, lens, window, interpret, monkeypatch):
    """Long contexts at small batches: each split's partial sums merged by the second kernel; splits
    with no key (short rows, the window) must count for nothing."""
    monkeypatch.setattr(triton_attention, "SPLITS", splits)
    check_fused((32, 4, 64), lens, window, monkeypatch)


def test_splits_only_for_long_contexts_of_few_sequences():
    assert triton_attention.splits_for(1, 4, 256) == 1
    assert triton_attention.splits_for(1, 4, 1024) == 4
    assert triton_attention.splits_for(1, 4, 8192) == 16
    assert triton_attention.splits_for(4, 4, 4096) == 8  # about 128 programs
    assert triton_attention.splits_for(16, 4, 4096) == 1  # 64 programs already


def check_fused(shape, lens, window, monkeypatch):
    heads, kv_heads, head_dim = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    query, key, value, batch = step_case(
        lens, heads, kv_heads, head_dim, torch.float32, seed=len(lens) + head_dim, device=device
    )
    expected, keys, values = torch_path(query, key, value, batch, window, None, monkeypatch)
    group = batch.decodes[0]
    out = triton_attention.decode(
        query,
        batch.cache.keys[0],
        batch.cache.values[0],
        group.blocks,
        group.lens,
        16,
        None,
        window,
        key,
        value,
        batch.slot_mapping,
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    # the new keys and values landed where the torch path put them, and nothing else changed
    assert torch.equal(batch.cache.keys[0], keys) and torch.equal(batch.cache.values[0], values)


BF16_INTERPRETED = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="Triton's interpreter multiplies bf16 matrices wrongly (tl.dot of a 16x16 bf16 tile off by 1e10); "
    "bf16 is checked compiled, on a GPU",
)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=BF16_INTERPRETED), torch.float16])
def test_half_precision_close_to_the_torch_path(dtype, interpret, monkeypatch):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    query, key, value, batch = step_case([3, 130, 64, 1], 32, 4, 64, dtype, seed=5, device=device)
    expected, _, _ = torch_path(
        query.float(),
        key.float(),
        value.float(),
        PagedBatch(
            type(batch.cache)([batch.cache.keys[0].float()], [batch.cache.values[0].float()]),
            batch.slot_mapping,
            decodes=batch.decodes,
        ),
        None,
        0.125,
        monkeypatch,
    )
    group = batch.decodes[0]
    out = triton_attention.decode(
        query,
        batch.cache.keys[0],
        batch.cache.values[0],
        group.blocks,
        group.lens,
        16,
        0.125,
        None,
        key,
        value,
        batch.slot_mapping,
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_without_the_write_reads_the_new_token_from_the_cache(interpret, monkeypatch):
    """The unfused form (the cache already written, as in a step mixing decodes and prompt chunks)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    query, key, value, batch = step_case([7, 64, 200], 9, 3, 64, torch.float32, seed=9, device=device)
    expected, keys, values = torch_path(query, key, value, batch, None, None, monkeypatch)
    group = batch.decodes[0]
    out = triton_attention.decode(query, keys, values, group.blocks, group.lens, 16, None, None)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_padding_rows_touch_only_the_scratch_slot(interpret, monkeypatch):
    """A graph's padding rows: context length 1, every block the scratch block, the new token into
    the scratch slot. Real rows' results and cache are as without them."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    query, key, value, batch = step_case([40, 90], 9, 3, 64, torch.float32, seed=11, device=device)
    group = batch.decodes[0]
    scratch = int(group.blocks.max()) + 1
    cache = batch.cache
    extra = torch.zeros(16, 3, 64, device=device)
    cache.keys[0], cache.values[0] = torch.cat([cache.keys[0], extra]), torch.cat([cache.values[0], extra])
    expected, keys, values = torch_path(query, key, value, batch, None, None, monkeypatch)
    blocks = torch.cat([group.blocks, torch.full((2, group.blocks.shape[1]), scratch, device=device)])
    lens = torch.cat([group.lens, torch.ones(2, dtype=torch.long, device=device)])
    slots = torch.cat([batch.slot_mapping, torch.full((2,), scratch * 16, device=device)])
    out = triton_attention.decode(
        torch.cat([query, query]),
        cache.keys[0],
        cache.values[0],
        blocks,
        lens,
        16,
        None,
        None,
        torch.cat([key, key]),
        torch.cat([value, value]),
        slots,
    )
    torch.testing.assert_close(out[:2], expected, atol=2e-5, rtol=2e-5)
    # a padding row attends to its one token: its own value
    torch.testing.assert_close(out[2:], value.repeat_interleave(3, dim=1), atol=1e-6, rtol=1e-6)
    assert torch.equal(cache.keys[0][: scratch * 16], keys[: scratch * 16])
    assert torch.equal(cache.values[0][: scratch * 16], values[: scratch * 16])


def test_the_engine_uses_it_on_cuda_only(monkeypatch):
    """On CPU the engine keeps its own kernels (native_attention), interpreter or not."""
    assert not triton_attention.available(torch.zeros(1, 4, 64))
    if torch.cuda.is_available():
        assert triton_attention.available(torch.zeros(1, 4, 64, device="cuda"))
        assert not triton_attention.available(torch.zeros(1, 4, 8, device="cuda"))  # head dim below 16


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_engine_on_cuda_gives_the_torch_paths_tokens(arch, eager, tiny_model_dir, tmp_path, monkeypatch):
    """float32 on a GPU, decode graphs on and off, a sliding window (Mistral) too: the kernel serves
    the decodes and the greedy tokens are the torch path's."""
    from test_decode_graphs import gpu_config
    from test_engine_greedy import run_all, workload
    from test_models import mistral_dir

    from goodput_runtime.engine.builder import build_core

    model = tiny_model_dir if arch == "llama" else mistral_dir(tiny_model_dir, tmp_path)
    cases = workload(seed=13, n=12)
    calls = []
    kernel = triton_attention.decode
    monkeypatch.setattr(triton_attention, "decode", lambda *a, **k: calls.append(len(a) + len(k)) or kernel(*a, **k))
    with_kernel = run_all(build_core(gpu_config(model, enforce_eager=eager)), cases)
    assert calls, "the Triton kernel was not used"
    monkeypatch.setattr(attention, "DECODE_KERNEL", "torch")
    assert with_kernel == run_all(build_core(gpu_config(model, enforce_eager=eager)), cases)


@pytest.mark.parametrize("window", [None, 8])
def test_start_up_launches_every_variant_a_model_steps_use(window, interpret, monkeypatch):
    """warm_up (run by the engine's build on CUDA) launches the fused and the unfused kernel, each
    with one program and with a split context, so none compiles under a request."""
    launched = []
    kernel = triton_attention.decode

    def record(
        query,
        k_cache,
        v_cache,
        blocks,
        lens,
        block_size,
        scaling,
        window,
        key=None,
        value=None,
        slots=None,
        splits=None,
        rotary=None,
    ):
        out = kernel(
            query, k_cache, v_cache, blocks, lens, block_size, scaling, window, key, value, slots, splits, rotary
        )
        assert torch.isfinite(out).all()
        launched.append((key is not None, splits, rotary is not None))
        return out

    monkeypatch.setattr(triton_attention, "decode", record)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    triton_attention.warm_up(32, 4, 64, 16, torch.float32, device, window)
    assert sorted(launched) == [(False, 1, False), (False, 2, False), (True, 1, False), (True, 2, False)]
    launched.clear()  # in half precision, also the rotary variant a layer's chain of GEMVs launches
    triton_attention.warm_up(32, 4, 64, 16, torch.float16, device, window)
    assert sorted(launched) == [
        (False, 1, False),
        (False, 2, False),
        (True, 1, False),
        (True, 1, True),
        (True, 2, False),
        (True, 2, True),
    ]


def rotary_rows(positions: list[int], head_dim: int, dtype: torch.dtype, device: str):
    """cos and sin [B, 1, D] at each row's position, as a Llama's rotary embedding makes them."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.tensor(positions).float()[:, None] * inv[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 2])
def test_the_rotary_embedding_applied_by_the_kernel_equals_rotating_first(dtype, splits, interpret, monkeypatch):
    """rotary=(cos, sin): the query and the new key come unrotated and the launch rotates them as it
    reads them (a layer's chain of GEMVs leaves it no kernel of its own). The output, and the key it
    stores, equal rotating in torch first (each product rounded to the dtype, as the model rounds it)
    then the kernel without it; and they differ from not rotating."""
    from goodput_runtime.layers.fused import rotate

    monkeypatch.setattr(triton_attention, "SPLITS", splits)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lens = [5, 130, 64, 1]
    query, key, value, batch = step_case(lens, 32, 4, 64, dtype, seed=21, device=device)
    cos, sin = rotary_rows([n - 1 for n in lens], 64, dtype, device)
    group, cache = batch.decodes[0], batch.cache

    def run(q, k, rotary=None):
        keys, values = cache.keys[0].clone(), cache.values[0].clone()
        out = triton_attention.decode(
            q, keys, values, group.blocks, group.lens, 16, None, None, k, value, batch.slot_mapping, rotary=rotary
        )
        return out, keys

    out, keys = run(query, key, (cos, sin))
    expected, expected_keys = run(rotate(query, cos, sin), rotate(key, cos, sin))
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(keys, expected_keys, atol=0, rtol=0)
    assert (out - run(query, key)[0]).abs().max() > 0.05


def test_attend_rotates_first_where_the_kernel_does_not_serve(monkeypatch):
    """attention.attend with rotary on the torch path (a CPU, or a step mixing prompts and decodes):
    the query and key rotated in torch, then attended as before."""
    from goodput_runtime.layers.fused import rotate

    query, key, value, batch = step_case([9, 40], 9, 3, 64, torch.float32, seed=23)
    cos, sin = rotary_rows([8, 39], 64, torch.float32, "cpu")
    expected, keys, _ = torch_path(
        rotate(query, cos, sin), rotate(key, cos, sin), value, batch, None, None, monkeypatch
    )
    out = attention.attend(batch, 0, query, key, value, rotary=(cos, sin))
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(batch.cache.keys[0], keys)


def test_a_rotary_variant_that_cannot_build_leaves_the_rotation_to_torch(interpret, monkeypatch):
    """warm_up: where the kernel's rotary variant fails to build (here its launch raises, as another
    Triton or GPU might), a warning names the error, the other variants still serve, and attend rotates
    the query and key in torch before the kernel, which then gets no `rotary`."""
    from goodput_runtime.layers.fused import rotate

    monkeypatch.setattr(triton_attention, "ROTARY", True)
    kernel = triton_attention.decode
    seen = []

    def decode(*args, rotary=None, **kwargs):
        seen.append(rotary is not None)
        if rotary is not None:
            raise RuntimeError("unsupported PTX instruction")
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "decode", decode)
    warned = []
    monkeypatch.setattr(triton_attention.log, "warning", lambda message, *args: warned.append(message % args))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    triton_attention.warm_up(32, 4, 64, 16, torch.float16, torch.device(device), None)
    assert triton_attention.ROTARY is False and len(warned) == 1 and "unsupported PTX" in warned[0]
    monkeypatch.setattr(triton_attention, "available", lambda q: True)
    query, key, value, batch = step_case([9, 40], 9, 3, 64, torch.float32, seed=29, device=device)
    cos, sin = rotary_rows([8, 39], 64, torch.float32, device)
    expected, keys, _ = torch_path(
        rotate(query, cos, sin), rotate(key, cos, sin), value, batch, None, None, monkeypatch
    )
    seen.clear()
    out = attention.attend(batch, 0, query, key, value, rotary=(cos, sin))
    assert True not in seen  # (on a CPU its own kernel attends; on CUDA Triton's, without `rotary`)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(batch.cache.keys[0], keys)


@pytest.mark.gpu
def test_the_kernel_launched_dependently_after_a_product_in_a_cuda_graph_gives_the_serial_results(monkeypatch):
    """GOODPUT_ATTENTION_PDL=on (Hopper on): the kernel launched before the qkv GEMV that feeds it ends,
    captured in a CUDA graph and replayed 50 times, gives bit for bit what ordinary launches give."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or later")
    lens = [5, 130, 64, 1]
    _, _, _, batch = step_case(lens, 32, 4, 64, torch.bfloat16, seed=23, device="cuda")
    group, cache = batch.decodes[0], batch.cache
    g = torch.Generator(device="cuda").manual_seed(1)
    weight = (torch.randn((32 + 2 * 4) * 64, 2048, device="cuda", generator=g) / 2048**0.5).to(torch.bfloat16)
    xs = torch.randn(len(lens), 2048, device="cuda", generator=g).to(torch.bfloat16)

    def layer():
        keys, values = cache.keys[0], cache.values[0]
        outs = []
        for i in range(len(lens)):  # one GEMV a sequence, as batch 1 runs it, each attended right after
            qkv = triton_linear.gemv(xs[i : i + 1], weight, None).view(1, 40, 64)
            row = slice(i, i + 1)
            outs.append(
                triton_attention.decode(
                    qkv[:, :32].contiguous(),
                    keys,
                    values,
                    group.blocks[row],
                    group.lens[row],
                    16,
                    None,
                    None,
                    qkv[:, 32:36].contiguous(),
                    qkv[:, 36:].contiguous(),
                    batch.slot_mapping[row],
                )
            )
        return torch.cat(outs)

    results = {}
    for pdl in (False, True):
        monkeypatch.setattr(triton_attention, "PDL", pdl)
        results[pdl] = replayed(layer)
    assert triton_linear.uses_pdl(torch.device("cuda"))
    assert torch.equal(results[True], results[False])
    assert torch.equal(results[False], results[False][: len(lens)].repeat(50, 1, 1))
