"""Decode steps over static buffers, replayed from captured CUDA graphs on a GPU.

A decode step of a small or medium model launches hundreds of small kernels; eagerly, the
GPU waits on Python and the launches far longer than on memory. This module gives decode-only
steps fixed shapes instead: the batch is padded up to one of a few batch sizes and the
attended context up to one of a few widths, every input lives in a buffer allocated once,
and each (batch, width) pair is captured as one CUDA graph at start and replayed per step.

Padding rows write their key and value into a scratch block that no sequence owns and attend
to that one slot, so they never touch a real sequence's cache. On CPU (or with capture off)
the same buffers and shapes run eagerly, so the path is exercised by the CPU tests too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from goodput_runtime.layers.attention import DecodeGroup, KVCache, PagedBatch

log = logging.getLogger(__name__)

MIN_WIDTH = 256  # the narrowest context bucket, in tokens
MAX_BATCH = 256  # the widest batch bucket captured, whatever --max-num-seqs says


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 32, then of 16 up to 64, then of 32: few graphs, little padding."""
    max_batch = max(1, min(max_batch, MAX_BATCH))
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    b = 8
    while b < max_batch:
        sizes.append(b)
        b += 8 if b < 32 else 16 if b < 64 else 32
    sizes.append(max_batch)
    return sizes


def width_buckets(block_size: int, max_len: int, min_width: int = MIN_WIDTH) -> list[int]:
    """Context widths in tokens, whole blocks, doubling from `min_width` up to the longest context."""
    top = -(-max_len // block_size) * block_size
    widths = []
    w = -(-min(min_width, top) // block_size) * block_size
    while w < top:
        widths.append(w)
        w *= 2
    widths.append(top)
    return widths


def pick(buckets: list[int], need: int) -> int | None:
    return next((b for b in buckets if b >= need), None)


@dataclass
class Shape:
    batch: int
    width: int


class DecodeGraphs:
    """Static-shape decode forward passes, captured as CUDA graphs when `capture` is true.

    `forward(input_ids [1, B], positions [1, B], batch)` is the model's pass returning logits [B, V].
    The cache must have one block more than the block manager hands out: `scratch_block`.
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, PagedBatch], torch.Tensor],
        cache: KVCache,
        block_size: int,
        scratch_block: int,
        max_batch: int,
        max_len: int,
        device: torch.device,
        capture: bool,
        max_tokens: int | None = None,
        min_width: int = MIN_WIDTH,
    ) -> None:
        self.forward = forward
        self.cache = cache
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.batches = batch_buckets(max_batch)
        self.widths = width_buckets(block_size, max_len, min_width)
        self.device = device
        self.capture_enabled = capture
        # pairs whose padded context (batch x width) exceeds what the cache holds run eagerly instead
        self.max_tokens = max_tokens
        b, blocks = self.batches[-1], self.widths[-1] // block_size
        scratch_slot = scratch_block * block_size
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((b,), scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((b, blocks), scratch_block, dtype=torch.long, device=device)
        self.lens = torch.ones(b, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None  # the memory pool all captured graphs share
        self.replays = 0  # decode steps served from this path
        self.capture_seconds = 0.0
        self.capture_bytes = 0  # device memory the captured graphs hold

    def shape_for(self, batch: int, max_context: int) -> Shape | None:
        b, w = pick(self.batches, batch), pick(self.widths, max_context)
        if b is None or w is None or not self.allowed(b, w):
            return None
        return Shape(b, w)

    def allowed(self, batch: int, width: int) -> bool:
        return self.max_tokens is None or batch * width <= max(self.max_tokens, self.widths[0])

    def _batch(self, shape: Shape) -> PagedBatch:
        b, blocks = shape.batch, shape.width // self.block_size
        group = DecodeGroup(slice(0, b), self.block_tables[:b, :blocks], self.lens[:b], self.block_size)
        return PagedBatch(self.cache, self.slot_mapping[:b], decodes=[group])

    def _run(self, shape: Shape) -> torch.Tensor:
        b = shape.batch
        return self.forward(self.input_ids[None, :b], self.positions[None, :b], self._batch(shape))

    def fill(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        lens: list[int],
        shape: Shape,
    ) -> None:
        """Copy one step's decodes into the static buffers, padding rows up to the shape's batch."""
        n, b = len(tokens), shape.batch
        blocks = shape.width // self.block_size
        pad = b - n
        scratch_slot = self.scratch_block * self.block_size
        table_rows = [t[:blocks] + [self.scratch_block] * (blocks - len(t[:blocks])) for t in tables]
        table_rows += [[self.scratch_block] * blocks] * pad
        host = torch.tensor(
            [tokens + [0] * pad, positions + [0] * pad, slots + [scratch_slot] * pad, lens + [1] * pad],
            dtype=torch.long,
        )
        non_blocking = self.device.type == "cuda"
        self.input_ids[:b].copy_(host[0], non_blocking=non_blocking)
        self.positions[:b].copy_(host[1], non_blocking=non_blocking)
        self.slot_mapping[:b].copy_(host[2], non_blocking=non_blocking)
        self.lens[:b].copy_(host[3], non_blocking=non_blocking)
        self.block_tables[:b, :blocks].copy_(torch.tensor(table_rows, dtype=torch.long), non_blocking=non_blocking)

    def run(self, shape: Shape, rows: int) -> torch.Tensor:
        """Logits [rows, V] of the step last filled in."""
        self.replays += 1
        entry = self.graphs.get((shape.batch, shape.width))
        if entry is None:
            return self._run(shape)[:rows]
        graph, logits = entry
        graph.replay()
        return logits[:rows]

    @torch.inference_mode()  # no autograd records; the static buffers stay ordinary tensors
    def capture(self) -> None:
        """Capture every (batch, width) pair, largest first so later graphs reuse its memory pool."""
        if not self.capture_enabled:
            return
        started = time.monotonic()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # free what the allocator caches, so the difference is the graphs' pool
        free_before = torch.cuda.mem_get_info(self.device)[0]
        for width in reversed(self.widths):
            for batch in reversed(self.batches):
                if not self.allowed(batch, width):
                    continue
                shape = Shape(batch, width)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):  # warm up kernels' lazy set-up outside the capture
                    for _ in range(2):
                        self._run(shape)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    logits = self._run(shape)
                self.pool = graph.pool()
                self.graphs[(batch, width)] = (graph, logits)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.capture_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.capture_seconds = time.monotonic() - started
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s, context widths %s) in %.1f s, %.0f MiB",
            len(self.graphs),
            self.batches,
            self.widths,
            self.capture_seconds,
            self.capture_bytes / 2**20,
        )
