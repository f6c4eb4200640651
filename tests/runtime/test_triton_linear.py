"""The batch-1 projections' Triton GEMV (layers/triton_linear.py) against torch's products.

Without a GPU the kernel runs through Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set
by tests/conftest.py): the same kernel source, every mask and tile, executed by numpy. The `gpu`
tests run it compiled: its start-up tuning on a 1B Llama's shapes, and an engine serving with it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_replays import replayed
from torch import nn
from torch.nn import functional as F

from goodput_runtime.layers import triton_attention, triton_linear
from goodput_runtime.models import llama

pytestmark = pytest.mark.skipif(not triton_attention.importable(), reason="Triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE)


def reference(x, w, b):
    """The product in float64 from the same rounded inputs."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize(
    "config",
    sorted(set(triton_linear.CANDIDATES + triton_linear.NORM_CANDIDATES)),
    ids=lambda c: "{}x{}-w{}".format(*c),
)
@pytest.mark.parametrize("shape", [(64, 512), (37, 100), (130, 1088)], ids=lambda s: "{}x{}".format(*s))
def test_every_candidate_tile_gives_the_product(config, shape, interpret):
    """Each tile the start-up tuning may pick: rows past N, columns past K (100 and 1,088 are no
    multiple of any tile's width), a bias; float32 inputs, so the only difference is summation order."""
    x, w, b = case(*shape, torch.float32, bias=True)
    out = triton_linear.gemv(x, w, b, config)
    assert out.shape == (1, shape[0]) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_half_precision_accumulates_in_float32(dtype, bias, interpret):
    """A half-precision product of 4,096 terms: summed in float32, only the output is rounded to the
    weight's dtype (summing in bf16 would be off by far more than one rounding)."""
    x, w, b = case(96, 4096, dtype, bias, seed=3)
    out = triton_linear.gemv(x, w, b)
    assert out.dtype == dtype
    expected = reference(x, w, b)
    eps = torch.finfo(dtype).eps
    assert ((out.double() - expected).abs() <= eps * expected.abs() + 1e-3).all()


def test_project_serves_one_row_through_the_kernel_and_more_rows_through_torch(interpret, monkeypatch):
    """A marked projection: a one-row product is the GEMV's (the decode step of a batch of one), two rows
    are F.linear's; an unmarked projection never reaches the kernel."""
    calls = []
    kernel = triton_linear.gemv
    monkeypatch.setattr(triton_linear, "gemv", lambda *a, **k: calls.append(a[1].shape) or kernel(*a, **k))
    linear = nn.Linear(256, 48, bias=True).to(DEVICE)
    plain = nn.Linear(256, 48).to(DEVICE)
    linear.gemv = True
    x = torch.randn(2, 256, device=DEVICE)
    with torch.inference_mode():
        one = llama.project(x[:1], linear)
        two = llama.project(x, linear)
        llama.project(x[:1], plain)
    assert calls == [(48, 256)]
    torch.testing.assert_close(one, two[:1], rtol=1e-5, atol=1e-5)


def test_only_half_precision_plain_projections_are_marked(tiny_model_dir, monkeypatch):
    """mark: every layer's four projections and the LM head of a bf16 model; none in float32 (whose
    products the exactness tests compare with cuBLAS's), none with GOODPUT_GEMV=off, and a quantized
    projection (another module type) keeps its own product."""
    from transformers import AutoModelForCausalLM

    def compact(dtype):
        return llama.from_transformers(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype))

    model = compact(torch.bfloat16)
    layers = len(model.model.layers)
    assert triton_linear.mark(model) == 4 * layers + 1
    assert all(getattr(lin, "gemv", False) for lin in model.linears())
    assert triton_linear.mark(compact(torch.float32)) == 0
    monkeypatch.setattr(triton_linear, "ENABLED", False)
    assert triton_linear.mark(compact(torch.bfloat16)) == 0
    monkeypatch.setattr(triton_linear, "ENABLED", True)
    model = compact(torch.bfloat16)
    model.model.layers[0].mlp.down_proj = QuantizedStandIn()
    assert triton_linear.mark(model) == 4 * layers


def test_a_gemv_that_cannot_start_leaves_cublas_serving(tiny_model_dir, monkeypatch):
    """enable: where the kernel fails to build or launch at start-up (here its launch raises, as an
    unsupported GPU or Triton would), every mark is taken back with a warning, so the server starts
    and projects through torch; where it starts, the marks stay."""
    from transformers import AutoModelForCausalLM

    model = llama.from_transformers(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16))

    def broken(*args, **kwargs):
        raise RuntimeError("PTX .version 9.9 does not support .target sm_99")

    monkeypatch.setattr(triton_linear, "gemv", broken)
    warned = []
    monkeypatch.setattr(triton_linear.log, "warning", lambda message, *args: warned.append(message % args))
    triton_linear.enable(model, torch.device("cpu"))
    assert not any(getattr(lin, "gemv", False) for lin in model.linears())
    assert len(warned) == 1 and "failed to start" in warned[0] and "sm_99" in warned[0]
    x = torch.randn(1, model.lm_head.in_features, dtype=torch.bfloat16)
    torch.testing.assert_close(llama.project(x, model.lm_head), model.lm_head(x))
    monkeypatch.setattr(triton_linear, "gemv", lambda x, w, b=None, c=None, **_: x.new_zeros(1, w.shape[0]))
    triton_linear.enable(model, torch.device("cpu"))
    assert all(getattr(lin, "gemv", False) for lin in model.linears())


class QuantizedStandIn(nn.Module):
    """A projection that is not a plain nn.Linear (as quantization's modules are)."""

    weight = torch.zeros(1, 1, dtype=torch.bfloat16)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU engine through the interpreter; on a GPU the gpu tests below serve"
)
@pytest.mark.parametrize("layer_path", ["chain", "chain-compiled", "cpu-fused"])
def test_a_batch_of_one_decodes_through_the_kernel_and_keeps_transformers_tokens(
    layer_path, tiny_model_dir, interpret, monkeypatch
):
    """The engine with its projections marked (as on a GPU; here float32 is let in, through the
    interpreter): a single request's decode steps take every product through the GEMV, and the greedy
    tokens are transformers'. The prompt's step keeps F.linear for its layers' products. `chain`: the
    layers as a GPU runs them (DecoderLayer.forward_gemv: each norm, SiLU x up and residual sum inside
    a product, the rotary embedding inside the attention kernel), eagerly or in the compiled graph
    (--compile, the GEMV an opaque operator there);
    `cpu-fused`: the CPU's fused element-wise functions between plain products."""
    from test_engine_greedy import reference, run_all, small_config

    from goodput_runtime.engine.builder import build_core
    from goodput_runtime.layers import fused

    if layer_path == "chain":
        monkeypatch.setattr(fused, "enabled", lambda x: False)  # the layers' forward, as on a GPU
    rotated_in_kernel = []
    if layer_path.startswith("chain"):  # decode attention through the Triton kernel, as on a GPU
        decode = triton_attention.decode
        monkeypatch.setattr(triton_attention, "available", lambda q: True)
        monkeypatch.setattr(
            triton_attention,
            "decode",
            lambda *a, **k: rotated_in_kernel.append(k.get("rotary") is not None) or decode(*a, **k),
        )
    core = build_core(
        dataclasses.replace(small_config(tiny_model_dir), step_tuning="off", compile=layer_path == "chain-compiled")
    )
    model = core.runner.model
    monkeypatch.setattr(triton_linear, "DTYPES", (torch.float32,))
    assert triton_linear.mark(model) == len(model.linears())
    rotated_in_kernel.clear()  # (the compiled graph's warm-up at start-up, before the marks)
    calls = []
    kernel = triton_linear.gemv
    monkeypatch.setattr(
        triton_linear,
        "gemv",
        lambda x, *a, **k: (
            calls.append(
                (
                    x.shape[0],
                    "norm" if k.get("norm") else "silu" if k.get("silu") else "",
                    k.get("residual") is not None,
                )
            )
            or kernel(x, *a, **k)
        ),
    )
    cases = [([5, 17, 300, 41, 9, 77], 6)]
    assert run_all(core, cases) == reference(tiny_model_dir, cases)
    # five decode steps after the prompt's, each every layer's four products and the head; and the
    # head of the prompt's step (its last row's logits alone)
    layers = len(model.model.layers)
    assert len(calls) == 5 * len(model.linears()) + 1 and {rows for rows, _, _ in calls} == {1}
    folded = {
        (kind, res): sum(1 for _, k, r in calls if (k, r) == (kind, res))
        for kind, res in [("norm", False), ("", True), ("silu", True)]
    }
    if layer_path.startswith("chain"):  # per layer: the qkv and gate-up products after norms; output and down
        assert folded == {("norm", False): 10 * layers, ("", True): 5 * layers, ("silu", True): 5 * layers}
        assert rotated_in_kernel == [True] * 5 * layers  # each decode step's attention rotated in the kernel
    else:
        assert not any(folded.values())


# Triton's interpreter rounds float32 to bfloat16 toward zero where torch and a GPU round to nearest:
# the folded work's bf16 roundings are checked on a GPU only (float16 rounds alike everywhere).
HALF = [
    torch.float16,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(DEVICE == "cpu", reason="the interpreter rounds to bfloat16 toward zero"),
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_the_norm_before_a_product_is_the_models_norm(dtype, interpret):
    """norm=(weight, eps): the product of the model's RMS norm of x (computed in float32 and rounded
    to the model's dtype as transformers' is), not of x; K = 1,088 is no multiple of the tile's width,
    so the sum of squares and the product both cross a partial tile."""
    x, w, b = case(80, 1088, dtype, bias=True, seed=5)
    x = x * 3 + 1  # far from unit RMS: a norm left out would show
    weight = (torch.rand(1088, generator=torch.Generator().manual_seed(6)) + 0.5).to(dtype).to(DEVICE)
    out = triton_linear.gemv(x, w, b, norm=(weight, 1e-5))
    expected = reference(llama.rms_norm(x, weight, 1e-5), w, b)
    assert out.shape == (1, 80) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert ((out.double() - expected).abs() <= tol * expected.abs() + 1e-4).all()
    assert (out.double() - reference(x, w, b)).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_silu_times_up_before_and_the_residual_after_a_product(dtype, interpret):
    """silu=True on x = [gate | up] [1, 2K] with a residual: residual + W @ (silu(gate) * up), the
    product rounded to the model's dtype before the sum, as the model's layer adds it."""
    gate_up, w, _ = case(70, 2 * 300, dtype, bias=False, seed=7)
    w = w[:, :300].contiguous()
    residual = torch.randn(1, 70, generator=torch.Generator().manual_seed(8)).to(dtype).to(DEVICE)
    out = triton_linear.gemv(gate_up, w, None, silu=True, residual=residual)
    act = F.silu(gate_up[:, :300]) * gate_up[:, 300:]
    product = reference(act, w, None)
    expected = product.to(dtype).double() + residual.double()
    tol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert out.dtype == dtype
    assert ((out.double() - expected).abs() <= tol * (product.abs() + expected.abs()) + 1e-4).all()
    plain = triton_linear.gemv(act.contiguous(), w, None, residual=residual)
    torch.testing.assert_close(out, plain, rtol=tol, atol=1e-4)


@pytest.mark.gpu
def test_start_up_tuning_picks_a_tile_no_slower_than_the_default_on_a_1b_llamas_shapes():
    """On a GPU: for a 1B Llama's projections in bf16 the tuned tile is the fastest of those timed (the
    default among them), gives the product, and is what later calls use."""
    shapes = [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (32000, 2048)]
    picked = triton_linear.tune(shapes, torch.bfloat16, torch.device("cuda"))
    for n, k in shapes:
        config, seconds = picked[(n, k)]
        assert triton_linear.config_for(n, k, torch.bfloat16) == config
        assert seconds > 0
        x, w, b = case(n, k, torch.bfloat16, bias=False)
        expected = reference(x, w, b)
        assert ((triton_linear.gemv(x, w).double() - expected).abs() <= 2**-7 * expected.abs() + 1e-2).all()
    normed = triton_linear.tune(shapes[:3:2], torch.bfloat16, torch.device("cuda"), norm=True)
    for (n, k), (config, _) in normed.items():  # the products after a norm: tuned on their own
        assert config in triton_linear.NORM_CANDIDATES
        assert triton_linear.config_for(n, k, torch.bfloat16, norm=True) == config


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_engine_on_cuda_in_bf16_serves_a_batch_of_one_through_the_kernel_under_graphs(
    eager, tiny_model_dir, monkeypatch
):
    """bf16 on a GPU: with the decode graphs, start-up marks the projections and a single request's
    decode steps use the GEMV; with --enforce-eager none is marked (launched eagerly, cuBLAS costs less
    CPU time a call). Either way the greedy tokens are cuBLAS's (GOODPUT_GEMV=off)."""
    from test_decode_graphs import gpu_config
    from test_engine_greedy import run_all

    from goodput_runtime.engine.builder import build_core

    cases = [([5, 17, 300, 41, 9, 77], 24)]
    calls = []
    kernel = triton_linear.gemv
    monkeypatch.setattr(triton_linear, "gemv", lambda *a, **k: calls.append(bool(k.get("norm"))) or kernel(*a, **k))
    core = build_core(gpu_config(tiny_model_dir, dtype="bfloat16", enforce_eager=eager))
    marked = [getattr(lin, "gemv", False) for lin in core.runner.model.linears()]
    with_kernel = run_all(core, cases)
    if eager:
        assert not any(marked) and not calls
    else:
        assert all(marked) and calls, "the GEMV was not used"
        assert any(calls), "the layers did not run as the chain of GEMVs (norms folded in)"
    monkeypatch.setattr(triton_linear, "ENABLED", False)
    assert with_kernel == run_all(build_core(gpu_config(tiny_model_dir, dtype="bfloat16", enforce_eager=eager)), cases)


@pytest.mark.gpu
def test_a_chain_of_products_launched_dependently_in_a_cuda_graph_gives_the_serial_results(monkeypatch):
    """Programmatic dependent launch (on Hopper and later): each GEMV reads its first weight tile
    before the kernel before it ends (and, "early", lets the next start at once). A chain as a layer runs it (norm
    before, residual and SiLU x up folded in, each product reading the last one's output), captured
    in a CUDA graph and replayed 50 times, must give bit for bit what the chain gives launched
    without it: any read of an input before its writer finished would show."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or later")
    g = torch.Generator(device="cuda").manual_seed(0)

    def weight(n, k):
        return (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)

    w1, w2, w3, norm = weight(2048, 2048), weight(2 * 2816, 2048), weight(2048, 2816), weight(1, 2048)[0] + 1
    x = torch.randn(1, 2048, device="cuda", generator=g).to(torch.bfloat16)

    def chain():
        h = triton_linear.gemv(x, w1, None, residual=x)
        gate_up = triton_linear.gemv(h, w2, None, norm=(norm, 1e-5))
        return triton_linear.gemv(gate_up, w3, None, silu=True, residual=h)

    results = {}
    for pdl in ("off", "wait", "early"):
        monkeypatch.setattr(triton_linear, "PDL", pdl)
        results[pdl] = replayed(chain)
    assert triton_linear.uses_pdl(x.device)
    assert torch.equal(results["wait"], results["off"]) and torch.equal(results["early"], results["off"])
    assert torch.equal(results["off"], results["off"][:1].expand_as(results["off"]))
