"""LoRA updates on CUDA as two Triton kernels a projection, "shrink" and "expand", whatever the mix of
adapters in the step (layers/lora.py holds the stacks and the torch paths; this module imports Triton
and is imported only where the kernels are used).

- shrink: h = x @ a[:, slot] for each adapter row (a [in, slots, W], W = parts x R), accumulated in
  float32 and kept so in a scratch buffer;
- expand: y += h @ b[slot] (b [slots, W, out]) in place, h rounded to the stack's dtype first (as the
  torch path's first product is), the product accumulated in float32 and added to y's row in float32,
  then rounded to y's dtype once.

Base rows (slot 0) are in no tile: neither kernel reads or writes them.

**Tiles.** A step's adapter rows are cut into tiles of at most ``BLOCK_T`` rows of one slot, built once
a step from the sequences' spans (``plan``, called by ``LoraBatch.of``), so a tile's rows share one A
and one B and each kernel's inner loop is a ``tl.dot`` of a row tile with a weight tile. The model runner
orders a step's rows by adapter (step_inputs.lora_order), so an adapter's rows are usually one run of
adjacent rows, or one per padded decode group: a run is cut into contiguous tiles (its first row and
count), which read x and y as they lie. The runs of a slot shorter than a tile, where there are several
(rows in the scheduler's order), are pooled into gathered tiles whose rows are listed in the plan; a
tile of a slot is made of such segments. Each row is in exactly one tile, so the expand kernel's
programs write disjoint parts of y, without atomics.

A plan is one int32 tensor copied to the device once a step: four numbers per tile (slot, first row or
offset of its row list, row count, gathered), then the gathered tiles' rows. Both kernels launch over
(tiles, output tiles): shrink over W's tiles, expand over out's; masks cover partial tiles (rows past a
tile's count, W and out not multiples of the tile, in not a multiple of ``BLOCK_K``). ``BLOCK_T`` is 16
(the least ``tl.dot`` takes), or 64 where some run has 64 rows or more (prompt chunks), so that a weight
tile read serves more rows. float32 stacks multiply in IEEE float32 (not TF32), as torch's products do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import triton
import triton.language as tl


class Stack(Protocol):
    """What the kernels read of a projection's adapters (layers/lora.py's LoraStack)."""

    a: torch.Tensor  # [in, slots, W]
    b: torch.Tensor  # [slots, W, out]


SHORT, LONG = 16, 64  # rows per tile: decode steps, and steps with a run of LONG rows or more
BLOCK_K = 64  # shrink: columns of x per loop iteration
BLOCK_N = 64  # expand: output columns per program
FIELDS = 4  # per tile: slot, first, count, gathered


@dataclass
class Plan:
    """A step's adapter rows as tiles (see the module's docstring)."""

    meta: torch.Tensor  # int32 [tiles * FIELDS + gathered rows]
    tiles: int
    block_t: int
    scratch: dict[int, torch.Tensor] = field(default_factory=dict)  # h [tiles * block_t, W] by W

    def h(self, width: int) -> torch.Tensor:
        """The shrink's output for a stack of width W: one buffer a step (a projection's expand reads it
        before the next projection's shrink writes it, on the same stream)."""
        h = self.scratch.get(width)
        if h is None:
            h = torch.empty(self.tiles * self.block_t, width, dtype=torch.float32, device=self.meta.device)
            self.scratch[width] = h
        return h


def plan(spans: list[tuple[int, int, int]], device: torch.device) -> Plan | None:
    """From (slot, first row, row count) per sequence of the step (slot 0 the base model); None when no
    row is on an adapter."""
    runs: dict[int, list[list[int]]] = {}  # slot: [first, count] of each run of adjacent rows
    for slot, first, count in spans:
        if slot == 0 or count == 0:
            continue
        of_slot = runs.setdefault(slot, [])
        if of_slot and of_slot[-1][0] + of_slot[-1][1] == first:
            of_slot[-1][1] += count
        else:
            of_slot.append([first, count])
    if not runs:
        return None
    block = LONG if max(count for of_slot in runs.values() for _, count in of_slot) >= LONG else SHORT
    tiles: list[tuple[int, int, int, int]] = []
    gathered: list[list[int]] = []  # each gathered tile's rows
    for slot in sorted(runs):
        short = [run for run in runs[slot] if run[1] < block]
        for first, count in runs[slot] if len(short) == 1 else [run for run in runs[slot] if run[1] >= block]:
            tiles += [
                (slot, start, min(block, first + count - start), 0) for start in range(first, first + count, block)
            ]
        if len(short) > 1:
            pooled = [row for first, count in short for row in range(first, first + count)]
            for start in range(0, len(pooled), block):
                gathered.append(pooled[start : start + block])
                tiles.append((slot, -1, len(gathered[-1]), 1))
    offset = FIELDS * len(tiles)
    meta: list[int] = []
    for slot, first, count, is_gathered in tiles:
        if is_gathered:
            first, offset = offset, offset + count
        meta += [slot, first, count, is_gathered]
    meta += [row for rows in gathered for row in rows]
    return Plan(torch.tensor(meta, dtype=torch.int32, device=device), len(tiles), block)


@triton.jit
def _tile_rows(meta_ptr, BLOCK_T: tl.constexpr):
    """This program's tile: its slot, its rows of x and y (int64), which of BLOCK_T are in it, and where
    its rows of h begin."""
    tile = tl.program_id(0)
    slot = tl.load(meta_ptr + tile * 4).to(tl.int64)
    first = tl.load(meta_ptr + tile * 4 + 1)
    count = tl.load(meta_ptr + tile * 4 + 2)
    gathered = tl.load(meta_ptr + tile * 4 + 3)
    offs = tl.arange(0, BLOCK_T)
    in_tile = offs < count
    listed = tl.load(meta_ptr + first + offs, mask=in_tile & (gathered != 0), other=0)
    rows = tl.where(gathered != 0, listed, first + offs).to(tl.int64)
    return slot, rows, in_tile, tile.to(tl.int64) * BLOCK_T + offs


@triton.jit
def shrink(
    x_ptr,
    a_ptr,
    h_ptr,
    meta_ptr,
    K,
    W,
    stride_x,
    stride_ak,
    stride_as,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """h[tile's rows, W tile] = x[rows] @ a[:, slot, W tile], in float32."""
    slot, rows, in_tile, h_rows = _tile_rows(meta_ptr, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    in_w = cols < W
    acc = tl.zeros((BLOCK_T, BLOCK_W), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < K
        xt = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=in_tile[:, None] & in_k[None, :], other=0.0)
        at = tl.load(
            a_ptr + ks[:, None].to(tl.int64) * stride_ak + slot * stride_as + cols[None, :],
            mask=in_k[:, None] & in_w[None, :],
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(xt, at, input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
    tl.store(h_ptr + h_rows[:, None] * W + cols[None, :], acc, mask=in_tile[:, None] & in_w[None, :])


@triton.jit
def expand(
    y_ptr,
    h_ptr,
    b_ptr,
    meta_ptr,
    N,
    W,
    stride_y,
    stride_bs,
    stride_bw,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """y[tile's rows, N tile] += h[tile's rows] @ b[slot, :, N tile], summed in float32, rounded once."""
    slot, rows, in_tile, h_rows = _tile_rows(meta_ptr, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for w0 in range(0, W, BLOCK_W):
        ws = w0 + tl.arange(0, BLOCK_W)
        in_w = ws < W
        ht = tl.load(h_ptr + h_rows[:, None] * W + ws[None, :], mask=in_tile[:, None] & in_w[None, :], other=0.0)
        bt = tl.load(
            b_ptr + slot * stride_bs + ws[:, None] * stride_bw + cols[None, :],
            mask=in_w[:, None] & in_n[None, :],
            other=0.0,
        )
        ht = ht.to(bt.dtype)  # h rounded to the stack's dtype, as the torch path's first product is
        if IEEE:
            acc += tl.dot(ht, bt, input_precision="ieee")
        else:
            acc += tl.dot(ht, bt)
    where = y_ptr + rows[:, None] * stride_y + cols[None, :]
    mask = in_tile[:, None] & in_n[None, :]
    y = tl.load(where, mask=mask, other=0.0)
    tl.store(where, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _block(width: int) -> int:
    """A tile of W: its power of two from 16 (tl.dot's least) up to 64."""
    return min(64, max(16, triton.next_power_of_2(width)))


def add_(y: torch.Tensor, x: torch.Tensor, stack: Stack, plan: Plan) -> None:
    """y [T, out] += each adapter row's (x [T, in] @ A_slot) @ B_slot: one shrink and one expand launch."""
    a, b = stack.a, stack.b
    k, width, n = a.shape[0], a.shape[2], b.shape[2]
    assert x.dtype == a.dtype and x.shape[1] == k and y.shape[1] == n, (x.shape, x.dtype, a.shape, y.shape)
    assert a.stride(2) == 1 and b.stride(2) == 1, "the stacks are made contiguous"
    if x.stride(1) != 1:
        x = x.contiguous()
    out = y if y.stride(1) == 1 else y.contiguous()
    h = plan.h(width)
    ieee = a.dtype == torch.float32
    block_w = _block(width)
    shrink[(plan.tiles, triton.cdiv(width, block_w))](
        x,
        a,
        h,
        plan.meta,
        k,
        width,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        BLOCK_T=plan.block_t,
        BLOCK_W=block_w,
        BLOCK_K=BLOCK_K,
        IEEE=ieee,
    )
    expand[(plan.tiles, triton.cdiv(n, BLOCK_N))](
        out,
        h,
        b,
        plan.meta,
        n,
        width,
        out.stride(0),
        b.stride(0),
        b.stride(1),
        BLOCK_T=plan.block_t,
        BLOCK_W=block_w,
        BLOCK_N=BLOCK_N,
        IEEE=ieee,
    )
    if out is not y:
        y.copy_(out)
