"""Batch-1 projections on CUDA as a Triton GEMV, tuned at start-up for the model's shapes.

At batch 1 a decode step is the weights read once: each projection is a matrix-vector product
whose time is its weight's bytes over the memory's bandwidth. cuBLAS serves a one-row product with
kernels made for wider ones: on an H200 they read the large matrices at 2.2-3.6 TB/s and an 8 MB
output projection at 1.5 TB/s, and the down projection adds a split-K reduction kernel. `gemv`
(triton_kernels.gemv) gives each program a few rows of the weight to stream once, multiplying in
float32 and summing across the row only at the end.

Which tile serves a shape best depends on the shape and the GPU, so `tune` times a few candidate
tiles for each of the model's shapes at start-up (CUDA graphs of launches over copies of the weight
that together exceed the L2 cache, as a decode step reads it) and keeps the fastest; a shape never
tuned takes DEFAULT. The engine uses it for bfloat16 and float16 weights on one GPU, with its decode
CUDA graphs (`mark`): float32 keeps cuBLAS, whose products the exactness tests compare against, and
so does --enforce-eager, where each launch's CPU time counts and Triton's costs more than cuBLAS's.
``GOODPUT_GEMV=off`` turns it off for a process. Under ``TRITON_INTERPRET=1`` the same kernel runs
on CPU tensors, as the CPU tests check it.

A layer's one-token step then runs as a chain of four GEMV launches (models.llama's
DecoderLayer.forward_gemv) with the small work between them folded in, since at batch 1 each small
kernel and the gap before it cost about as much as the work itself. Folded in are the RMS norm
before the qkv and gate-up products, the residual sums after the output and down projections, and
SiLU x up before the down projection. Each is rounded to the model's dtype where the eager modules
round it. On Hopper the GEMVs are launched with programmatic dependent launch (PDL).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

ENABLED = os.environ.get("GOODPUT_GEMV", "auto") != "off"
# A decoder layer's batch-1 step as four products with the work between them folded in (models.llama):
# the norms into the products after them, SiLU x up into the down projection, the residual sums into
# the output and down projections. Off: inductor's kernels between the products, as before.
FUSE = os.environ.get("GOODPUT_GEMV_FUSE", "on") != "off"
# Programmatic dependent launch (Hopper on): "wait", each GEMV may start before the kernel before it
# ends, reading its first weight tile, then waits for it; "early", it also lets the next GEMV start
# at once; "off".
PDL = os.environ.get("GOODPUT_GEMV_PDL", "wait")
DTYPES = (torch.bfloat16, torch.float16)

Config = tuple[int, int, int]  # rows per program, columns per iteration, warps
# On an H200 (bench/gpu_gemv.py, 24 tiles on a 1B Llama's five shapes in bf16), 2 rows x 1,024 columns
# with 4 warps was the fastest on every shape, 1.05x to 1.55x cuBLAS; the next best there are the other
# candidates, and two wider ones the grid did not hold.
DEFAULT: Config = (2, 1024, 4)
CANDIDATES: tuple[Config, ...] = (
    DEFAULT,
    (1, 2048, 4),
    (2, 2048, 4),
    (4, 1024, 8),
    (8, 1024, 8),
    (16, 256, 4),
    (16, 512, 4),
    (8, 512, 4),
)
TUNE_BYTES = 256 << 20  # weight copies a tuning graph cycles through: well beyond an H200's 60 MB of L2
TUNE_MIN_BYTES = 4 << 20  # smaller weights take DEFAULT: their call is mostly launch and tail, whatever the tile
# With the RMS norm before it, each program also reads the whole input and the norm's weight (for
# its sum of squares and its tiles): from the L2 cache, but as much again as its rows of weight at
# two rows a program. Taller tiles share that among more rows; the norm's product is tuned on its own.
NORM_DEFAULT: Config = (8, 512, 4)
NORM_CANDIDATES: tuple[Config, ...] = (
    NORM_DEFAULT,
    DEFAULT,
    (4, 1024, 4),
    (8, 1024, 8),
    (16, 256, 4),
    (16, 512, 8),
    (32, 256, 8),
    (32, 128, 4),
)
_chosen: dict[tuple[int, int, torch.dtype, bool], Config] = {}


def _kernels() -> Any:
    from goodput_runtime.layers import triton_kernels  # imports Triton: only where it is used

    return triton_kernels


def config_for(n: int, k: int, dtype: torch.dtype, norm: bool = False) -> Config:
    return _chosen.get((n, k, dtype, norm), NORM_DEFAULT if norm else DEFAULT)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: Config | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    silu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T (+ bias [N]) (+ residual [1, N]) -> [1, N] in x's dtype, accumulated
    in float32. norm (the RMS norm's weight [K], eps): the product of rms_norm(x) instead; silu: of
    silu(gate) * up for x = [gate | up] [1, 2K]."""
    n, k = weight.shape
    assert x.shape == (1, 2 * k if silu else k) and weight.stride(1) == 1, (x.shape, weight.shape, weight.stride())
    assert not (silu and norm), "one prologue at a time"
    x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    rows, cols, warps = config or config_for(n, k, weight.dtype, norm is not None)
    pdl = {"launch_pdl": True} if uses_pdl(x.device) else {}
    _kernels().gemv[(-(-n // rows),)](
        x,
        weight,
        x if bias is None else bias,
        out,
        x if norm is None else norm[0],
        x if residual is None else residual.contiguous(),
        n,
        k,
        weight.stride(0),
        0.0 if norm is None else norm[1],
        HAS_BIAS=bias is not None,
        EVEN_K=k % cols == 0,
        BLOCK_N=rows,
        BLOCK_K=cols,
        NORM=norm is not None,
        SILU=silu,
        HAS_RES=residual is not None,
        PDL=bool(pdl),
        EARLY=bool(pdl) and PDL == "early",
        num_warps=warps,
        **pdl,
    )
    return out


def uses_pdl(device: torch.device) -> bool:
    """Launch with programmatic dependent launch: on Hopper GPUs and later, unless PDL is off."""
    return PDL != "off" and device.type == "cuda" and _capability(device.index or 0) >= 9


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@torch.library.custom_op("goodput::gemv", mutates_args=())
def gemv_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gemv` as an operator the compiled graph keeps opaque (models.llama's project and forward_gemv)."""
    return gemv(x, weight, bias, norm=None if norm_weight is None else (norm_weight, eps), silu=silu, residual=residual)


@gemv_op.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    return x.new_empty(1, weight.shape[0])


def replay_seconds(launches: list[Callable[[], Any]], reps: int = 5) -> float:
    """Device seconds per launch: `launches` (each run once first, which compiles) captured `reps`
    times over into one CUDA graph, replayed; the median of 5 replays, over the launches."""
    for launch in launches:
        launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for launch in launches:
                launch()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return sorted(times)[2] / (reps * len(launches))


def weight_copies(n: int, k: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Copies of an [n, k] weight, together at least TUNE_BYTES (two at least): a graph cycling through
    them reads each from memory, not from the L2 cache."""
    size = n * k * dtype.itemsize
    copies = min(64, max(2, math.ceil(TUNE_BYTES / size)))
    return [torch.randn(n, k, dtype=dtype, device=device) * 0.02 for _ in range(copies)]


def tune(
    shapes: Iterable[Iterable[int]],
    dtype: torch.dtype,
    device: torch.device,
    candidates: Iterable[Config] | None = None,
    norm: bool = False,
) -> dict[tuple[int, int], tuple[Config, float]]:
    """Time each candidate tile on each [N, K] shape of at least TUNE_MIN_BYTES (with the RMS norm
    before the product where `norm`, among NORM_CANDIDATES by default); keep the fastest for `gemv`.
    Returns, per shape timed, the chosen tile and its device seconds a call."""
    candidates = tuple(candidates or (NORM_CANDIDATES if norm else CANDIDATES))
    picked = {}
    size = dtype.itemsize
    for n, k in sorted({tuple(shape) for shape in shapes}):
        if n * k * size < TUNE_MIN_BYTES:
            continue
        weights = weight_copies(n, k, dtype, device)
        x = torch.randn(1, k, dtype=dtype, device=device)
        prologue = (torch.ones(k, dtype=dtype, device=device), 1e-6) if norm else None
        timed = {
            c: replay_seconds([functools.partial(gemv, x, w, None, c, norm=prologue) for w in weights])
            for c in candidates
        }
        best = min(timed, key=timed.__getitem__)
        _chosen[(n, k, dtype, norm)] = best
        picked[(n, k)] = (best, timed[best])
        del weights
    torch.cuda.empty_cache()
    return picked


def mark(model: Any) -> int:
    """Let `project` serve the model's one-row products through `gemv` (the plain nn.Linear ones with a
    bfloat16 or float16 weight): marks them; how many. A model without `linears()` (transformers'
    modules) keeps cuBLAS."""
    if not ENABLED or importlib.util.find_spec("triton") is None or not hasattr(model, "linears"):
        return 0
    marked = 0
    for linear in model.linears():
        if type(linear) is nn.Linear and linear.weight.dtype in DTYPES and linear.weight.is_contiguous():
            linear.__dict__["gemv"] = True  # a plain attribute (never in a state dict): models.llama.project
            marked += 1
    return marked


def enable(model: Any, device: torch.device) -> None:
    """On a GPU: mark the model's projections, tune a tile for each of their shapes, and compile every
    variant of the kernel they launch (with a bias or without), so no request waits for either. Where
    the kernel cannot be built or run there (another Triton, another GPU), the marks are taken back and
    cuBLAS serves: the server starts either way."""
    marked = mark(model)
    if not marked:
        return
    started = time.monotonic()
    linears = [lin for lin in model.linears() if getattr(lin, "gemv", False)]
    dtype = linears[0].weight.dtype
    try:
        # the products an RMS norm precedes (models.decoder_layer.DecoderLayer.forward_gemv) are tuned with it
        normed = [lin for lin in getattr(model, "normed_linears", list)() if FUSE and getattr(lin, "gemv", False)]
        try:
            picked = {(n, k, ""): c for (n, k), c in tune([lin.weight.shape for lin in linears], dtype, device).items()}
            picked.update(
                {
                    (n, k, " after the norm"): c
                    for (n, k), c in tune([lin.weight.shape for lin in normed], dtype, device, norm=True).items()
                }
            )
        except torch.cuda.OutOfMemoryError:  # its weight copies did not fit beside the cache: default tiles
            log.warning(
                "no memory to tune the batch-1 GEMV's tiles; every shape takes %s (%s after a norm)",
                DEFAULT,
                NORM_DEFAULT,
            )
            picked = {}
            torch.cuda.empty_cache()
        with torch.inference_mode():
            for lin in linears:
                warm_up(lin, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # any failure to build or launch it leaves cuBLAS serving
        for lin in linears:
            lin.__dict__["gemv"] = False
        log.warning(
            "the batch-1 Triton GEMV failed to start (%s: %s); cuBLAS serves every product", type(e).__name__, e
        )
        return
    log.info(
        "batch-1 projections through the Triton GEMV (%d of them); tuned in %.1f s: %s",
        marked,
        time.monotonic() - started,
        ", ".join(
            f"{n}x{k}{what}: {c[0]} rows x {c[1]} cols, {c[2]} warps, {s * 1e6:.1f} us"
            for (n, k, what), (c, s) in picked.items()
        ),
    )


def warm_up(linear: nn.Linear, device: torch.device) -> None:
    """Compile the kernel's variants a marked projection can launch: the plain product and, for the
    fused layer (models.decoder_layer.DecoderLayer.forward_gemv), with the norm before it, the residual after
    it, and SiLU x up before and the residual after it."""
    k, n, dtype = linear.in_features, linear.out_features, linear.weight.dtype
    x = torch.zeros(1, k, dtype=dtype, device=device)
    gemv(x, linear.weight, linear.bias)
    if FUSE:
        residual = torch.zeros(1, n, dtype=dtype, device=device)
        gemv(x, linear.weight, linear.bias, norm=(torch.ones(k, dtype=dtype, device=device), 1e-6))
        gemv(x, linear.weight, linear.bias, residual=residual)
        gemv(
            torch.zeros(1, 2 * k, dtype=dtype, device=device), linear.weight, linear.bias, silu=True, residual=residual
        )
