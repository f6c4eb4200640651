"""Whole KV cache blocks moved as a unit: copy-on-write copies inside the cache, and blocks copied
out to and in from host memory (the offload tier, a KV transfer)."""

from __future__ import annotations

import time
from typing import Any

import torch

from goodput_runtime.engine.step import StepItem
from goodput_runtime.layers.attention import KVCache


class CacheBlocks:
    """The model runner's block copies, over its cache (the attributes below are the runner's)."""

    cache: KVCache
    block_size: int
    device: torch.device
    dtype: torch.dtype
    offload: Any

    def block_payload_shape(self) -> tuple[int, ...]:
        """One block's keys then values, every layer: what the offload tier stores per block."""
        keys = self.cache.keys[0]
        return (2 * len(self.cache.keys), self.block_size, *keys.shape[1:])

    def _by_block(self) -> list[torch.Tensor]:
        """Every layer's keys then values, viewed as [blocks, block_size, kv_heads, head_dim]."""
        bs = self.block_size
        return [c.view(-1, bs, *c.shape[1:]) for c in (*self.cache.keys, *self.cache.values)]

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Each block's keys and values (block_payload_shape), copied to host memory: one gather per
        layer into one buffer; each block's part of it is contiguous."""
        ids = torch.tensor(block_ids, device=self.device)
        layers = self._by_block()
        rows = torch.empty((len(block_ids), *self.block_payload_shape()), dtype=self.dtype, device=self.device)
        for i, cache in enumerate(layers):
            rows[:, i] = cache.index_select(0, ids)
        rows = rows.cpu()
        return list(rows.unbind(0))

    def write_blocks(self, block_ids: list[int], payloads: list[bytearray]) -> None:
        """Copy each payload (block_payload_shape, the cache's dtype) into its block."""
        shape = self.block_payload_shape()
        data = torch.stack([torch.frombuffer(p, dtype=self.dtype).view(shape) for p in payloads]).to(self.device)
        ids = torch.tensor(block_ids, device=self.device)
        for i, cache in enumerate(self._by_block()):
            cache.index_copy_(0, ids, data[:, i])

    @torch.inference_mode()
    def transfer_blocks(self, saves: list[tuple[int, int]], loads: list[tuple[int, bytearray]]) -> None:
        """Before a step: copy evicted blocks out to the offload tier (its writer thread writes them),
        then copy loaded ones in. Saves first: a block saved here may be loaded into or written now."""
        if saves and self.offload is not None:
            started = time.perf_counter()
            for (_, digest), rows in zip(saves, self.read_blocks([b for b, _ in saves]), strict=True):
                self.offload.save_async(digest, rows)
            self.offload.observe_save_copy(time.perf_counter() - started)
        if loads:
            started = time.perf_counter()
            self.write_blocks([b for b, _ in loads], [p for _, p in loads])
            if self.offload is not None:
                self.offload.observe_copy(time.perf_counter() - started)

    def _copy_blocks(self, items: list[StepItem]) -> None:
        """Make the step's copy-on-write block copies, in every layer's keys and values."""
        pairs = [pair for item in items for pair in item.block_copies]
        if not pairs:
            return
        bs = self.block_size
        offsets = torch.arange(bs, device=self.device)
        source = (torch.tensor([s for s, _ in pairs], device=self.device)[:, None] * bs + offsets).reshape(-1)
        target = (torch.tensor([d for _, d in pairs], device=self.device)[:, None] * bs + offsets).reshape(-1)
        for cache in (*self.cache.keys, *self.cache.values):
            cache.index_copy_(0, target, cache.index_select(0, source))
