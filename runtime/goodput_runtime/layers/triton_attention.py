"""Paged decode attention on CUDA as one Triton kernel, straight over the paged cache.

The torch path of a decode step spends, per layer, two cache writes (``index_copy_``), two block
gathers into new tensors and a scaled-dot-product-attention call: five or more kernels of a few
microseconds each around a few hundred KiB of keys and values. At batch 1 on an H100 they were
a quarter of the step. This kernel does the same work in one launch: each program takes one
sequence and one kv head, stores the step's new key and value into the cache, then runs an
online softmax for the heads of that kv head's group over the sequence's blocks, read where they
lie (block table, context length and window from device memory, so a CUDA graph replays it), and
takes the new token's own key and value from registers. With few sequences and long contexts the
context is split across several programs per sequence and kv head, and a second kernel merges
their partial softmax sums (`splits_for`).

Scores are accumulated in float32; with float32 caches the products run in IEEE float32 (not
TF32), so the greedy tokens match the torch path's. Triton is imported lazily: ``available``
says whether this process can use the kernel (CUDA tensors, Triton importable, head dim 16..256).
``TRITON_INTERPRET=1``, set before Triton is first imported, runs the same kernel on CPU tensors
through Triton's interpreter: how the CPU tests check it against the torch path.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from typing import Any

import torch

from goodput_runtime.layers import triton_linear

log = logging.getLogger(__name__)


@functools.cache
def importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(query: torch.Tensor) -> bool:
    """Whether the engine uses `decode` for this query: a CUDA tensor, Triton importable, a head dim of
    16..256. (Under the interpreter, `decode` also runs on CPU tensors, for tests.)"""
    return query.is_cuda and 16 <= query.shape[-1] <= 256 and importable()


def _kernels() -> Any:
    from goodput_runtime.layers import triton_kernels  # imports Triton: only where it is used

    return triton_kernels


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, least: int) -> int:
    p = least
    while p < n:
        p *= 2
    return p


# whether `decode` may take `rotary` (attention.attend asks): False where its variant failed to build
ROTARY = os.environ.get("GOODPUT_ATTENTION_ROTARY", "on") != "off"
# GOODPUT_ATTENTION_PDL=on: launched with programmatic dependent launch where the GEMVs are
# (layers/triton_linear.PDL, Hopper on), so the launch overlaps the end of the qkv product before it.
# Off by default until a GPU has timed it and checked its tokens (hack/gpu-checks.sh gemvstep: `attnpdl`).
PDL = os.environ.get("GOODPUT_ATTENTION_PDL", "off") == "on"
TILE: int | None = None  # keys per loop iteration; None: tile()'s 128 (bench/gpu_attention.py sweeps it)


def tile() -> int:
    """Keys per loop iteration: 128 (on an H200, 128 beat 32 and 64 at every batch and context
    bench/gpu_attention.py tried), whatever the width, so that a model compiles few variants."""
    return TILE or 128


SPLITS: int | None = None  # programs per (sequence, kv head); None: splits_for(...) (the bench sweeps it)


def splits_for(batch: int, kv_heads: int, width: int) -> int:
    """Programs per (sequence, kv head). One program walks a whole context, so with few sequences a
    long context is a chain of dependent loads on a handful of the GPU's 100+ multiprocessors (on an
    H200, at batch 1, 1.04x the torch path's speed at 1,024 tokens against 2.5x at 256). From 1,024
    tokens of context, and while there are fewer than 64 programs, the context is split into ranges
    of at least 256 keys, for about 128 programs, and a second small kernel merges the splits."""
    if SPLITS is not None:
        return SPLITS
    programs = batch * kv_heads
    if width < 1024 or programs >= 64:
        return 1
    return max(1, min(width // 256, _cdiv(128, programs), 16))


def decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scaling: float | None,
    window: int | None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    splits: int | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """query [B, H, D] -> [B, H, D], each row attended to its context in the paged cache.

    k_cache, v_cache [num_slots, KVH, D], contiguous; blocks [B, N] each row's cache blocks; lens [B]
    context lengths including the new token. With key and value [B, KVH, D] and slots [B], the new
    tokens' keys and values are stored into the cache by the same launch (otherwise the cache must
    already hold them). `splits`: programs per (sequence, kv head), splits_for's when None. `rotary`:
    each row's cos and sin [B, ..., D] (one position a row); the query and the new key then come
    unrotated, and the launch applies the rotary embedding (rotate-half) as it reads them.
    """
    b, heads, dim = query.shape
    kv_heads = k_cache.shape[1]
    fused = key is not None and value is not None and slots is not None
    # without the write, the kernel never reads key, value or slots (that code is compiled out)
    new_k, new_v, new_slots = (key, value, slots) if fused else (query, query, lens)
    assert new_k is not None and new_v is not None and new_slots is not None
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    query, new_k, new_v, blocks = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, new_k, new_v, blocks))
    out = torch.empty((b, heads, dim), dtype=query.dtype, device=query.device)
    if b == 0:
        return out
    group = heads // kv_heads
    width = blocks.shape[1] * block_size
    tile_keys = tile()
    splits = splits or splits_for(b, kv_heads, width)
    chunk = _cdiv(_cdiv(width, splits), tile_keys) * tile_keys  # keys per split, whole tiles
    g_pad, d_pad = _pow2(group, 16), _pow2(dim, 16)
    if splits > 1:
        part_m = torch.empty(b * kv_heads * splits * g_pad, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(part_m.numel() * d_pad, dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out  # unread
    cos, sin = (query, query) if rotary is None else (t.reshape(t.shape[0], -1) for t in rotary)
    assert rotary is None or (
        cos.shape == sin.shape == (b, dim) and cos.stride(1) == sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)
    ), (cos.shape, sin.shape)
    kernels = _kernels()
    pdl = {"launch_pdl": True} if PDL and triton_linear.uses_pdl(query.device) else {}
    kernels.paged_decode[(b, kv_heads, splits)](
        query,
        new_k,
        new_v,
        k_cache,
        v_cache,
        new_slots,
        blocks,
        lens,
        out,
        part_m,
        part_l,
        part_acc,
        cos,
        sin,
        float(dim**-0.5 if scaling is None else scaling),
        int(window or 0),
        chunk,
        query.stride(0),
        query.stride(1),
        new_k.stride(0),
        new_k.stride(1),
        new_v.stride(0),
        new_v.stride(1),
        out.stride(0),
        out.stride(1),
        blocks.stride(0),
        cos.stride(0),
        KVH=kv_heads,
        D=dim,
        D_PAD=d_pad,
        G=group,
        G_PAD=g_pad,
        BLOCK=block_size,
        TILE=tile_keys,
        HAS_WINDOW=window is not None,
        FUSED_WRITE=fused,
        IEEE=query.dtype == torch.float32,
        SPLIT=splits > 1,
        ROTARY=rotary is not None,
        PDL=bool(pdl),
        num_warps=4,
        **pdl,
    )
    if splits > 1:
        kernels.merge_splits[(b, kv_heads)](
            part_m,
            part_l,
            part_acc,
            out,
            out.stride(0),
            out.stride(1),
            splits,
            KVH=kv_heads,
            D=dim,
            D_PAD=d_pad,
            G=group,
            G_PAD=g_pad,
            num_warps=4,
        )
    return out


def warm_up(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    window: int | None,
) -> None:
    """Compile, before the first request, each variant of the kernels a model's steps launch: with and
    without the fused write (decode-only steps, and steps mixing decodes with prompt chunks), one
    program or a split context (and the merge), in half precision also with the rotary embedding.
    Triton compiles a variant on its first launch, a second or so that would otherwise fall on a
    request. Launched on scratch tensors."""
    width = 2 * block_size
    keys, values = (torch.zeros(width, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2))
    query = torch.zeros(1, heads, head_dim, dtype=dtype, device=device)
    new = torch.zeros(1, kv_heads, head_dim, dtype=dtype, device=device)
    blocks, lens = torch.tensor([[0, 1]], device=device), torch.tensor([width], device=device)
    rows = torch.zeros(1, head_dim, dtype=dtype, device=device)
    global ROTARY
    for splits in (1, 2):
        decode(
            query,
            keys,
            values,
            blocks,
            lens,
            block_size,
            None,
            window,
            new,
            new,
            torch.tensor([width - 1], device=device),
            splits=splits,
        )
        decode(query, keys, values, blocks, lens, block_size, None, window, splits=splits)
        if dtype != torch.float32 and ROTARY:  # a half-precision layer's chain (models.llama.forward_gemv)
            try:
                decode(
                    query,
                    keys,
                    values,
                    blocks,
                    lens,
                    block_size,
                    None,
                    window,
                    new,
                    new,
                    torch.tensor([width - 1], device=device),
                    splits=splits,
                    rotary=(rows, rows),
                )
            except Exception as e:  # the chain then rotates in torch (attention.attend): the server starts
                ROTARY = False
                log.warning(
                    "the decode kernel's rotary variant failed to build (%s: %s); the rotary embedding runs before it",
                    type(e).__name__,
                    e,
                )
