"""Paged attention behind transformers' attention interface.

transformers' model code projects queries, keys and values and applies rotary embeddings;
the function ``register()`` installs takes over from there: it writes the step's keys and values
into the paged cache and attends each sequence to its own context. The step is one flat
row of tokens: single-token decodes first (attended as one padded batch), then prefill
chunks (each attended on its own, causally, after its cached context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "goodput_paged"


@dataclass
class KVCache:
    keys: list[torch.Tensor]  # per layer: [num_slots, kv_heads, head_dim]
    values: list[torch.Tensor]

    @classmethod
    def allocate(cls, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> KVCache:
        def make() -> list[torch.Tensor]:
            return [torch.zeros(num_slots, kv_heads, head_dim, dtype=dtype, device=device)
                    for _ in range(num_layers)]
        return cls(make(), make())


@dataclass
class DecodeGroup:
    """Single-token decodes of similar context length, attended as one padded batch."""

    rows: slice
    slots: torch.Tensor  # [B * L] context slots, each row padded to L
    lens: torch.Tensor  # [B] context length including the new token
    width: int  # L


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


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None,
                    dropout: float = 0.0, sliding_window: int | None = None, **kwargs):
    # query: [1, H, T, D]; key, value: [1, KVH, T, D] for the step's new tokens only
    batch: PagedBatch = kwargs["paged"]
    layer: int = module.layer_idx  # type: ignore[assignment]
    k_cache, v_cache = batch.cache.keys[layer], batch.cache.values[layer]
    k_cache.index_copy_(0, batch.slot_mapping, key[0].transpose(0, 1))
    v_cache.index_copy_(0, batch.slot_mapping, value[0].transpose(0, 1))
    kv_heads, head_dim = key.shape[1], key.shape[3]
    gqa = query.shape[1] != kv_heads
    out = torch.empty(query.shape[2], query.shape[1], head_dim, dtype=query.dtype, device=query.device)

    for i, group in enumerate(batch.decodes):
        b = group.rows.stop - group.rows.start
        q = query[0, :, group.rows].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        k = gather(k_cache, group.slots).view(b, group.width, kv_heads, head_dim).transpose(1, 2)  # [B, KVH, L, D]
        v = gather(v_cache, group.slots).view(b, group.width, kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.decode_mask(i, sliding_window),
                                           scale=scaling, enable_gqa=gqa)
        out[group.rows] = o.squeeze(2)
    for i, chunk in enumerate(batch.prefills):
        q = query[:, :, chunk.rows]  # [1, H, n, D]
        if chunk.slots is None:
            k, v = key[:, :, chunk.rows], value[:, :, chunk.rows]
        else:
            k = gather(k_cache, chunk.slots).transpose(0, 1).unsqueeze(0)  # [1, KVH, start + n, D]
            v = gather(v_cache, chunk.slots).transpose(0, 1).unsqueeze(0)
        mask = batch.prefill_mask(i, sliding_window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=scaling, enable_gqa=gqa)
        out[chunk.rows] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None  # [1, T, H, D]


def register() -> str:
    """Make ``paged_attention`` transformers' attention implementation ``ATTN_IMPLEMENTATION``,
    for models loaded after this call; the name to load them with. Calling it again is harmless.

    No mask function is registered beside it: transformers then builds no mask at all (the paged
    function builds its own from the step's layout) and skips its packed-sequence check, which
    would read a tensor on the host every step and cannot run inside a CUDA graph capture.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
