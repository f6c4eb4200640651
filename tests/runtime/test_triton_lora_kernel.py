"""The LoRA shrink/expand kernels (layers/triton_lora.py) against the torch paths of LoraStack.add_.

Without a GPU the kernels run through Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by
tests/conftest.py): the same source, every tile and mask, executed by numpy. The interpreter multiplies
bfloat16 tiles wrongly (tl.dot of bf16 off by orders of magnitude) and rounds float32 to bfloat16
toward zero, so bfloat16 is checked compiled, by the `gpu` tests (hack/gpu-checks.sh lora), which also
serve an engine's steps with adapters through the kernels.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from goodput_runtime.layers import lora, triton_attention

pytestmark = pytest.mark.skipif(not triton_attention.importable(), reason="Triton is not installed")

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(not GPU, reason="the interpreter multiplies bf16 tiles wrongly; checked on a GPU"),
)


def kernels():
    from goodput_runtime.layers import triton_lora

    return triton_lora


def make_stack(in_features, out_sizes, max_rank, ranks, dtype, seed=0, slots=4, device=DEVICE):
    """A stack whose slots 1.. hold random adapters of the given ranks (per slot, every part), B scaled."""
    g = torch.Generator().manual_seed(seed)
    stack = lora.LoraStack(slots, in_features, out_sizes, max_rank, dtype, torch.device(device))
    for slot, rank in enumerate(ranks, start=1):
        for part, out in enumerate(out_sizes):
            a = torch.randn(rank, in_features, generator=g) / in_features**0.5
            b = torch.randn(out, rank, generator=g)
            stack.set(slot, part, a, b, scaling=0.5)
    return stack


def inputs(rows, in_features, out, dtype, seed=1, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g).to(dtype).to(device)
    y = torch.randn(rows, out, generator=g).to(dtype).to(device)
    return x, y


def both(stack, x, y0, spans):
    """(kernel's y, torch path's y) from the same y0."""
    y, expected = y0.clone(), y0.clone()
    plan = kernels().plan(spans, x.device)
    kernels().add_(y, x, stack, plan)
    stack.add_(expected, x, lora.LoraBatch.of(spans, x.device, kernel=False))
    return y, expected


def check(y, expected, y0, stack, x, spans):
    """float32: within 1e-4 of the torch path; float16/bfloat16: within four roundings of the result's
    scale (|y0| + |x| |A| |B|); rows of the base model (and rows of no span) left bit for bit."""
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    else:
        scale = y0.double().abs()
        for slot, first, count in spans:
            if slot:
                rows = slice(first, first + count)
                a, b = stack.a[:, slot].double().abs(), stack.b[slot].double().abs()
                scale[rows] += (x[rows].double().abs() @ a) @ b
        assert ((y.double() - expected.double()).abs() <= 4 * torch.finfo(y.dtype).eps * scale + 1e-6).all()
    adapter_rows = {r for slot, first, count in spans if slot for r in range(first, first + count)}
    untouched = [r for r in range(len(y)) if r not in adapter_rows]
    assert torch.equal(y[untouched], y0[untouched])
    assert not torch.equal(y[sorted(adapter_rows)], y0[sorted(adapter_rows)])


def mixed_spans(rows, seed):
    """Sequences of random lengths over `rows` rows, each on slot 0..3, ordered by slot as the model
    runner orders them (base rows first, as in a decode group led by a base row)."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < rows:
        lengths.append(min(rng.choice([1, 1, 1, 2, 7]), rows - sum(lengths)))
    slots = sorted(rng.randrange(4) for _ in lengths)
    if rows > 1 and len(lengths) > 1:
        slots[-1] = 3  # some adapter row in every case
    spans, first = [], 0
    for slot, length in zip(slots, lengths, strict=True):
        spans.append((slot, first, length))
        first += length
    return spans


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_mixed_slots_and_base_rows_odd_shapes(rows, dtype, interpret):
    """in = 45, out = 67 (no multiple of any tile), rank 8 on slots 1-3, a step mixing them with the
    base model; one row alone is on slot 2."""
    stack = make_stack(45, [67], 8, [8, 8, 8], dtype)
    x, y0 = inputs(rows, 45, 67, dtype)
    spans = [(2, 0, 1)] if rows == 1 else mixed_spans(rows, seed=rows)
    y, expected = both(stack, x, y0, spans)
    assert y.dtype == dtype
    check(y, expected, y0, stack, x, spans)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_fused_parts_ranks_below_the_maximum_and_scattered_rows(dtype, interpret):
    """Three parts (as the fused QKV: 32 + 16 + 19 columns), ranks 3, 8 and 5 under a maximum of 8 (zero
    columns between the parts' ranks), the rows of each adapter in several short runs (the scheduler's
    order, gathered tiles) and one long run (contiguous tiles)."""
    stack = make_stack(45, [32, 16, 19], 8, [3, 8, 5], dtype, seed=2)
    x, y0 = inputs(40, 45, 67, dtype, seed=3)
    spans = [(1, 0, 1), (2, 1, 1), (0, 2, 1), (1, 3, 2), (3, 5, 1), (2, 6, 1), (1, 7, 1), (0, 8, 2)]
    spans += [(3, 10, 20), (2, 30, 3), (0, 33, 7)]
    plan = kernels().plan(spans, x.device)
    assert 1 in plan.meta[: plan.tiles * kernels().FIELDS].view(-1, kernels().FIELDS)[:, 3].tolist()
    y, expected = both(stack, x, y0, spans)
    check(y, expected, y0, stack, x, spans)
    # each part's update lands in its own columns: with part 1 cleared, only columns 32..47 change
    stack.b[:, 8:16].zero_()
    y_without, _ = both(stack, x, y0, spans)
    assert torch.equal(y_without[:, 32:48], y0[:, 32:48])
    assert not torch.equal(y_without[:, :32], y0[:, :32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_stack_wider_than_a_tile(dtype, interpret):
    """Rank 32 in three parts: W = 96 columns, so the shrink runs two programs across W (the second
    half filled) and the expand sums over two tiles of W; one adapter at the full rank, one at 20."""
    stack = make_stack(70, [40, 24, 24], 32, [32, 20], dtype, slots=3, seed=6)
    x, y0 = inputs(21, 70, 88, dtype, seed=7)
    spans = [(0, 0, 4), (1, 4, 9), (2, 13, 6), (0, 19, 2)]
    y, expected = both(stack, x, y0, spans)
    check(y, expected, y0, stack, x, spans)


def test_one_adapter_every_row_and_a_prompt_long_enough_for_wide_tiles(interpret):
    """Every row on one adapter (no base row), 130 rows: tiles of 64 rows, the last partial."""
    stack = make_stack(45, [67], 16, [16], torch.float32, slots=2, seed=4)
    x, y0 = inputs(130, 45, 67, torch.float32, seed=5)
    spans = [(1, 0, 100), (1, 100, 30)]
    plan = kernels().plan(spans, x.device)
    assert plan.block_t == 64 and plan.tiles == 3
    y, expected = both(stack, x, y0, spans)
    check(y, expected, y0, stack, x, spans)


@pytest.mark.parametrize("seed", range(3))
def test_every_adapter_row_is_in_exactly_one_tile_of_its_slot(seed):
    """The plan (no kernel): each adapter row once, in a tile of its own slot and of at most BLOCK_T
    rows; no base row anywhere."""
    rng = random.Random(seed)
    spans, first = [], 0
    for _ in range(rng.randrange(1, 40)):
        count = rng.choice([1, 1, 1, 3, 70])
        spans.append((rng.randrange(5), first, count))
        first += count
    if not any(slot for slot, _, _ in spans):
        spans.append((1, first, 1))
    plan = kernels().plan(spans, torch.device("cpu"))
    meta = plan.meta.tolist()
    seen: dict[int, int] = {}
    for t in range(plan.tiles):
        slot, start, count, gathered = meta[4 * t : 4 * t + 4]
        assert 0 < count <= plan.block_t and slot > 0
        rows = meta[start : start + count] if gathered else list(range(start, start + count))
        for row in rows:
            assert row not in seen
            seen[row] = slot
    expected = {r: slot for slot, first, count in spans if slot for r in range(first, first + count)}
    assert seen == expected


def test_the_kernels_serve_where_use_kernel_says(monkeypatch):
    """CUDA tensors with Triton importable, unless GOODPUT_LORA_KERNEL=off; a CPU keeps the torch paths."""
    monkeypatch.setattr(lora, "KERNEL", "auto")
    assert not lora.use_kernel(torch.device("cpu"))
    assert lora.use_kernel(torch.device("cuda"))
    assert lora.LoraBatch.of([(1, 0, 2)], "cpu").plan is None
    monkeypatch.setattr(lora, "KERNEL", "off")
    assert not lora.use_kernel(torch.device("cuda"))


def test_stack_add_runs_the_kernels_and_a_failing_kernel_falls_back_once(interpret, monkeypatch):
    """LoraStack.add_ with a planned batch calls the kernels; where they raise (a GPU or Triton they
    cannot build for) a warning is logged once and the torch paths give the update from then on."""
    monkeypatch.setattr(lora, "KERNEL", "auto")
    stack = make_stack(45, [67], 8, [8, 4], torch.float32, slots=3)
    x, y0 = inputs(9, 45, 67, torch.float32)
    spans = [(1, 0, 3), (0, 3, 2), (2, 5, 4)]
    batch = lora.LoraBatch.of(spans, x.device, kernel=True)
    assert batch.plan is not None and not batch.empty and batch.groups == []
    calls = []
    add = kernels().add_
    monkeypatch.setattr(kernels(), "add_", lambda *a: calls.append(1) or add(*a))
    y, expected = y0.clone(), y0.clone()
    stack.add_(y, x, batch)
    stack.add_(expected, x, lora.LoraBatch.of(spans, x.device, kernel=False))
    assert calls == [1] and lora.KERNEL == "auto"
    check(y, expected, y0, stack, x, spans)

    def broken(*args):
        raise RuntimeError("PTX .version 9.9 does not support .target sm_99")

    warned = []
    monkeypatch.setattr(kernels(), "add_", broken)
    monkeypatch.setattr(lora.log, "warning", lambda message, *args: warned.append(message % args))
    for _ in range(2):
        y = y0.clone()
        stack.add_(y, x, batch)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert lora.KERNEL == "off" and len(warned) == 1 and "sm_99" in warned[0]
    assert not lora.use_kernel(torch.device("cuda"))


def random_adapter(model_dir, out, rank, modules, seed):
    """A PEFT adapter directory with random A and B (made without peft, which a GPU machine may lack)."""
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, head_dim, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    dims = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    dims |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module in modules:
            fin, fout = dims[module]
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fin, generator=g) / fin**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * 0.1
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules, "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        "all8": random_adapter(tiny_model_dir, root / "all8", 8, every, seed=0),
        "qvd4": random_adapter(tiny_model_dir, root / "qvd4", 4, ["q_proj", "v_proj", "down_proj"], seed=1),
    }


def engine_tokens(model_dir, adapters, monkeypatch, kernel: bool, **settings):
    """Greedy tokens of a mixed batch (two adapters and the base model, prompts beside decodes), the
    step's adapter rows through the kernels or the torch paths; and the kernels' calls."""
    from test_lora_engine import config, run

    from goodput_runtime.engine.builder import build_core

    calls = []
    if kernel:
        add = kernels().add_
        monkeypatch.setattr(kernels(), "add_", lambda *a: calls.append(a[0].shape[0]) or add(*a))
        if not GPU:  # the interpreter, on CPU tensors
            monkeypatch.setattr(lora, "use_kernel", lambda device: True)
    monkeypatch.setattr(lora, "KERNEL", "auto" if kernel else "off")
    core = build_core(config(model_dir, adapters, **settings))
    rng = random.Random(6)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (9, 21, 5)]
    prompts.append(prompts[0])  # the first prompt again, on the base model
    tokens = run(core, [(p, 4, n) for p, n in zip(prompts, ["all8", None, "qvd4", None], strict=True)])
    assert (lora.KERNEL == "auto") is kernel, "the kernels failed and the torch paths served"
    return tokens, calls


@pytest.mark.skipif(GPU, reason="through the interpreter; on a GPU the gpu test below serves")
def test_an_engine_serves_mixed_adapters_through_the_interpreted_kernels(
    tiny_model_dir, adapters, interpret, monkeypatch
):
    """float32 on CPU with the kernels forced (through the interpreter): every step's adapter rows go
    through them, and the greedy tokens are the torch paths' (the adapter's differing from the base
    model's for the same prompt)."""
    expected, _ = engine_tokens(tiny_model_dir, adapters, monkeypatch, kernel=False)
    tokens, calls = engine_tokens(tiny_model_dir, adapters, monkeypatch, kernel=True)
    assert calls and tokens == expected
    assert tokens[0] != tokens[3]  # the adapter changes what the model says


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 33, 300])
def test_compiled_kernels_on_cuda(rows, dtype):
    """Compiled, on a GPU: a 1B Llama's fused QKV shapes (2048 in; 2048 + 256 + 256 out) and an odd one
    (45 in, 67 out, three parts), ranks 16 and 8 under 16, rows mixed with the base model."""
    for in_features, out_sizes in [(2048, [2048, 256, 256]), (45, [32, 16, 19])]:
        stack = make_stack(in_features, out_sizes, 16, [16, 8, 16], dtype, seed=rows)
        x, y0 = inputs(rows, in_features, sum(out_sizes), dtype, seed=rows)
        spans = [(2, 0, 1)] if rows == 1 else mixed_spans(rows, seed=rows)
        y, expected = both(stack, x, y0, spans)
        check(y, expected, y0, stack, x, spans)


@pytest.mark.gpu
def test_an_engine_on_cuda_serves_mixed_adapters_through_the_kernels(tiny_model_dir, adapters, monkeypatch):
    """An engine on CUDA in float32: every step with adapter rows runs them through the kernels, and the
    greedy tokens equal those of the torch paths (GOODPUT_LORA_KERNEL=off). (In bfloat16 a different
    summation order may round a value the other way and flip a near tie, so bf16 is checked per product
    above.)"""
    settings = {"device": "cuda"}
    expected, _ = engine_tokens(tiny_model_dir, adapters, monkeypatch, kernel=False, **settings)
    tokens, calls = engine_tokens(tiny_model_dir, adapters, monkeypatch, kernel=True, **settings)
    assert calls and tokens == expected
    assert tokens[0] != tokens[3]  # the adapter changes what the model says
