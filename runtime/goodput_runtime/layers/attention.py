"""Paged attention: the step's keys and values into the paged cache, each sequence attended to its context.

``attend`` does the work for one layer, on a step's queries, keys and values after the rotary
embedding. The runtime's own model modules (``goodput_runtime.models``) call it directly;
for the architectures served through transformers' model code, ``register()`` installs it
behind transformers' attention interface. The step is one flat row of tokens: single-token
decodes first (attended as padded batches of similar context lengths), then prefill chunks
(each attended on its own, causally, after its cached context).

A decode batch reads its context from the cache whole blocks at a time: one ``index_select``
of block rows (a few KiB each) per layer for keys and one for values, rather than one row per
cached token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from goodput_runtime.layers import native_attention, triton_attention
from goodput_runtime.layers.fused import rotate

ATTN_IMPLEMENTATION = "goodput_paged"


@dataclass
class KVCache:
    keys: list[torch.Tensor]  # per layer: [num_slots, kv_heads, head_dim]
    values: list[torch.Tensor]

    @classmethod
    def allocate(
        cls, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        def make() -> list[torch.Tensor]:
            return [torch.zeros(num_slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]

        return cls(make(), make())


@dataclass
class DecodeGroup:
    """Single-token decodes of similar context length, attended as one padded batch."""

    rows: slice
    blocks: torch.Tensor  # [B, L / block_size] cache blocks of each row's context, padded with any block
    lens: torch.Tensor  # [B] context length including the new token
    block_size: int

    @property
    def width(self) -> int:  # L: the padded context, whole blocks
        return self.blocks.shape[1] * self.block_size


@dataclass
class PrefillChunk:
    rows: slice  # rows of the flat step holding this chunk's queries
    start: int  # tokens of this sequence already in the cache
    slots: torch.Tensor | None  # [start + n] cache slots of the whole context; None when start == 0


@dataclass
class PagedBatch:
    cache: KVCache
    slot_mapping: torch.Tensor  # [T] where each new token's key and value go
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, i: int, window: int | None) -> torch.Tensor:
        # [B, 1, 1, L]: key j is visible when j < len (and j > pos - window)
        key = ("decode", i, window)
        if key not in self.masks:
            group = self.decodes[i]
            j = torch.arange(group.width, device=group.lens.device)[None, :]
            lens = group.lens[:, None]
            mask = j < lens
            if window is not None:
                mask &= j > lens - 1 - window
            self.masks[key] = mask[:, None, None, :]
        return self.masks[key]

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        # [n, start + n] causal after the cached context; None when plain causal suffices
        chunk = self.prefills[i]
        n = chunk.rows.stop - chunk.rows.start
        if chunk.start == 0 and window is None:
            return None
        key = ("prefill", i, window)
        if key not in self.masks:
            device = self.slot_mapping.device
            q = torch.arange(chunk.start, chunk.start + n, device=device)[:, None]
            k = torch.arange(chunk.start + n, device=device)[None, :]
            mask = k <= q
            if window is not None:
                mask &= k > q - window
            self.masks[key] = mask
        return self.masks[key]


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return torch.index_select(cache, 0, slots)


# how a decode group's blocks are read: "index_select", or "index" (advanced indexing over the
# blocks seen as 8-byte words: on CUDA, index_select's kernel for few indices walks each block
# element by element, about 10 us a layer for 16 blocks on an H100 against 2 us for the copy);
# "auto" is index on CUDA, index_select elsewhere
GATHER = "auto"

# how a decode group is attended: "native" (straight over the paged cache, no gathers: on CPU
# native_attention's C++ kernel, on CUDA triton_attention's Triton kernel, which also stores the
# step's keys and values in a decode-only step; the torch path wherever neither runs), or "torch"
# (the blocks gathered, then scaled_dot_product_attention); "auto" is native.
# GOODPUT_DECODE_ATTENTION=torch turns the kernels off for a process (to compare, or to rule them out).
DECODE_KERNEL = os.environ.get("GOODPUT_DECODE_ATTENTION", "auto")
# how a prompt chunk is attended: "native" (the same extension's causal kernel over the chunk's
# context in the cache: its keys packed once per layer, sixteen query rows against sixteen keys at a
# time, online softmax; CPU with AVX-512 only), or "torch" (the context gathered when the chunk
# follows cached tokens, then scaled_dot_product_attention); "auto" is native where it runs, except
# for bfloat16: there torch's CPU flash attention multiplies in bf16 on oneDNN's AMX / AVX-512 BF16
# kernels where the native kernel computes in fp32, and ran SmolLM2's heads 1.4x (128 tokens) to 3.8x
# (2,048) as fast, 2.2x for 512 tokens after 512 or 1,536 cached ones, gather included (one thread,
# Xeon with AMX). GOODPUT_PREFILL_ATTENTION=torch turns the kernel off for a process, =native takes
# it for bfloat16 too.
PREFILL_KERNEL = os.environ.get("GOODPUT_PREFILL_ATTENTION", "auto")
for _name, _value in (("GOODPUT_DECODE_ATTENTION", DECODE_KERNEL), ("GOODPUT_PREFILL_ATTENTION", PREFILL_KERNEL)):
    if _value not in ("auto", "native", "torch"):
        raise ValueError(f"{_name}={_value!r}: expected auto, native or torch")


def gather_blocks(cache: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
    """[B, KVH, L, D]: each row's context, read from the cache a block at a time."""
    b = group.blocks.shape[0]
    kv_heads, head_dim = cache.shape[1], cache.shape[2]
    row = group.block_size * kv_heads * head_dim
    blocks = cache.view(-1, row)
    how = GATHER if GATHER != "auto" else "index" if cache.is_cuda else "index_select"
    if how == "index" and row * cache.element_size() % 8 == 0:
        rows = blocks.view(torch.int64)[group.blocks.reshape(-1)].view(cache.dtype)
    else:
        rows = torch.index_select(blocks, 0, group.blocks.reshape(-1))
    return rows.view(b, group.width, kv_heads, head_dim).transpose(1, 2)


def kernel_attends_decodes(cache: KVCache) -> bool:
    """Whether a kernel, not the torch path, attends the decodes over this cache (the native one on a
    CPU, Triton's on CUDA), each row over its own context length."""
    if DECODE_KERNEL == "torch" or not cache.keys:
        return False
    keys = cache.keys[0]
    if keys.device.type == "cpu":
        return keys.dtype in native_attention.DTYPES and native_attention.available()
    return triton_attention.available(keys)


def attend_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    mask: torch.Tensor,
    scaling: float | None,
    gqa: bool,
    window: int | None,
) -> torch.Tensor:
    """query [B, H, D] of one decode group -> [B, H, D]; mask is the group's decode_mask for window."""
    if DECODE_KERNEL != "torch" and not query.is_cuda:
        out = native_attention.decode(
            query, k_cache, v_cache, group.blocks, group.lens, group.block_size, scaling, window
        )
        if out is not None:
            return out
    if DECODE_KERNEL != "torch" and triton_attention.available(query):
        return triton_attention.decode(
            query, k_cache, v_cache, group.blocks, group.lens, group.block_size, scaling, window
        )
    o = F.scaled_dot_product_attention(
        query.unsqueeze(2),
        gather_blocks(k_cache, group),
        gather_blocks(v_cache, group),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=gqa,
    )
    return o.squeeze(2)


def attend(
    batch: PagedBatch,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None = None,
    sliding_window: int | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One layer's attention for the step: query [T, H, D], key and value [T, KVH, D] of the step's
    new tokens (written into the cache here); returns [T, H, D]. `rotary` (cos, sin [T, 1, D]): the
    query and key come unrotated, and the rotary embedding (rotate-half) is applied here, by the
    Triton kernel itself in a decode-only step on CUDA."""
    k_cache, v_cache = batch.cache.keys[layer], batch.cache.values[layer]
    if (
        len(batch.decodes) == 1
        and not batch.prefills
        and DECODE_KERNEL != "torch"
        and triton_attention.available(query)
        and (rotary is None or triton_attention.ROTARY)
    ):
        # a decode-only step on CUDA: the cache writes and the attention in one launch
        group = batch.decodes[0]
        return triton_attention.decode(
            query,
            k_cache,
            v_cache,
            group.blocks,
            group.lens,
            group.block_size,
            scaling,
            sliding_window,
            key,
            value,
            batch.slot_mapping,
            rotary=rotary,
        )
    if rotary is not None:
        query, key = rotate(query, *rotary), rotate(key, *rotary)
    k_cache.index_copy_(0, batch.slot_mapping, key)
    v_cache.index_copy_(0, batch.slot_mapping, value)
    gqa = query.shape[1] != key.shape[1]
    if len(batch.decodes) == 1 and not batch.prefills:
        # a decode-only step in one batch: no output buffer to copy into
        return attend_decode(
            query,
            k_cache,
            v_cache,
            batch.decodes[0],
            batch.decode_mask(0, sliding_window),
            scaling,
            gqa,
            sliding_window,
        )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for i, group in enumerate(batch.decodes):
        out[group.rows] = attend_decode(
            query[group.rows],
            k_cache,
            v_cache,
            group,
            batch.decode_mask(i, sliding_window),
            scaling,
            gqa,
            sliding_window,
        )
    native_prefill = not query.is_cuda and (
        PREFILL_KERNEL == "native" or (PREFILL_KERNEL == "auto" and query.dtype != torch.bfloat16)
    )
    for i, chunk in enumerate(batch.prefills):
        if native_prefill:
            slots = batch.slot_mapping[chunk.rows] if chunk.slots is None else chunk.slots
            native = native_attention.prefill(
                query[chunk.rows], k_cache, v_cache, slots, chunk.start, scaling, sliding_window
            )
            if native is not None:
                out[chunk.rows] = native
                continue
        q = query[chunk.rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.slots is None:
            k, v = key[chunk.rows], value[chunk.rows]
        else:
            k, v = gather(k_cache, chunk.slots), gather(v_cache, chunk.slots)  # [start + n, KVH, D]
        mask = batch.prefill_mask(i, sliding_window)
        o = F.scaled_dot_product_attention(
            q,
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scaling,
            enable_gqa=gqa,
        )
        out[chunk.rows] = o[0].transpose(0, 1)
    return out


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
):
    """transformers' attention interface: query [1, H, T, D]; key, value [1, KVH, T, D] of the step's
    new tokens only; returns [1, T, H, D]."""
    out = attend(
        kwargs["paged"],
        module.layer_idx,  # type: ignore[arg-type]
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        scaling,
        sliding_window,
    )
    return out.unsqueeze(0), None


def register() -> str:
    """Make ``paged_attention`` transformers' attention implementation ``ATTN_IMPLEMENTATION``,
    for models loaded after this call; the name to load them with. Calling it again is harmless.

    No mask function is registered beside it: transformers then builds no mask at all (the paged
    function builds its own from the step's layout) and skips its packed-sequence check, which
    would read a tensor on the host every step and cannot run inside a CUDA graph capture.
    """
    from transformers import AttentionInterface  # here: importing transformers' model code takes seconds

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
