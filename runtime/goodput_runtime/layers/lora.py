"""LoRA adapters on the compact modules' projections: many adapters in one step, each row its own.

Each projection an adapter may touch carries a ``LoraStack``: for every slot, the adapters' A
matrices side by side, ``a [in, slots, parts * R]``, and their B matrices (the scaling folded in)
block-diagonal, ``b [slots, parts * R, out]``, where R is ``--max-lora-rank`` and ``parts`` the
projections fused into this one (3 for the fused QKV, 2 for gate-up, 1 for o and down). Slot 0 is
the base model and stays zero; an adapter of a smaller rank, or without one of the parts, leaves
its columns zero. So a fused projection's update is one pair of products: ``(x @ a) @ b`` adds each
part's ``x A^T B^T scale`` to its own columns.

A step's rows reach the stacks through ``LoraBatch`` (set by the model runner around the forward
pass in ``ACTIVE``): the rows of sequences on adapters, by slot. Base rows cost nothing.

- Decode rows (one token per sequence) run, by ``DECODE_PATH`` (``GOODPUT_LORA_DECODE``):
  - ``grouped`` (the default): as prefill spans, one pair of products per adapter over its rows; it
    was the cheapest in two of three runs of bench/lora.py (SmolLM2, rank 16), by a few points;
  - ``dense``: the slots from the lowest to the highest the rows use, at once, two
    products per projection whatever the mix of adapters: ``x @ a`` over those slots' columns, each
    row's other slots' columns zeroed by a one-hot mask, then ``@ b``. Its products are that many times
    one adapter's, and its operations few: on a CPU a decode step's cost is mostly the number of
    operations (bench/lora.py). Where every row of the step is such a row, no rows are gathered or
    scattered, and with one slot there is no mask;
  - ``bmm``: gathered, each row's A and B copied out of its slot and multiplied as one batched product
    (about 5 MB copied a layer at 16 rows: the slowest, +42-96 % at batch 16).
- Prefill spans run grouped: each adapter's rows (one slice per sequence) multiplied by its own A
  and B, then added to their rows.

Grouped rows run one pair of products per run of adjacent rows of an adapter, on slices (no copy),
the second product added in place (``addmm_``). The model runner orders a step's rows by adapter
(step_inputs.lora_order), so an adapter's rows are one run, or one per padded decode group; an
adapter whose rows still lie in more than ``MAX_RUNS`` runs is gathered into one product.

On CUDA, where Triton is importable, every adapter row of a step runs instead through two Triton kernels
a projection, whatever the mix of adapters (layers/triton_lora.py: "shrink" x @ A, "expand" y += h @ B,
over tiles of one slot's rows planned once a step in ``LoraBatch.of``); ``GOODPUT_LORA_KERNEL=off``
keeps the torch paths there too. A kernel that fails to build or launch is reported once, and the
process goes on with the torch paths. A CPU always runs the torch paths.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from goodput_runtime.layers import triton_attention

if TYPE_CHECKING:
    from goodput_runtime.layers.triton_lora import Plan

log = logging.getLogger(__name__)

DECODE_PATHS = ("dense", "bmm", "grouped")
DECODE_PATH = os.environ.get("GOODPUT_LORA_DECODE", "grouped")
if DECODE_PATH not in DECODE_PATHS:
    raise ValueError(f"GOODPUT_LORA_DECODE={DECODE_PATH!r}: expected one of {', '.join(DECODE_PATHS)}")
KERNEL = os.environ.get("GOODPUT_LORA_KERNEL", "auto")  # "off": the torch paths on CUDA too
if KERNEL not in ("auto", "off"):
    raise ValueError(f"GOODPUT_LORA_KERNEL={KERNEL!r}: expected auto or off")


def _kernels() -> Any:
    from goodput_runtime.layers import triton_lora  # imports Triton: only where the kernels are used

    return triton_lora


def use_kernel(device: torch.device | str) -> bool:
    """Whether a step's rows on `device` run through the Triton kernels: CUDA, Triton importable, and
    GOODPUT_LORA_KERNEL not off (nor turned off by a kernel that failed)."""
    return KERNEL == "auto" and torch.device(device).type == "cuda" and triton_attention.importable()


@dataclass
class LoraBatch:
    """Which rows of a step run with which slot's adapter (base rows appear nowhere)."""

    decode_rows: torch.Tensor | None = None  # [n] rows of single-token sequences on adapters
    decode_slots: torch.Tensor | None = None  # [n] their slots
    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)  # (slot, rows): runs or gathered
    dense: bool = False  # decode rows run over the slots lo..hi at once (the one-hot mask)
    lo: int = 0  # the lowest and highest slot of the decode rows
    hi: int = 0
    every_row: bool = False  # the decode rows are all of the step's rows, in order
    masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # [n, hi - lo + 1, 1] one-hot
    plan: Plan | None = None  # the Triton kernels' tiles (triton_lora.plan); None: the torch paths
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # as given to `of`
    device: torch.device | str = "cpu"
    torch_paths: LoraBatch | None = None  # the same rows for the torch paths, once a kernel failed

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[n, hi - lo + 1, 1]: 1 at each decode row's slot."""
        mask = self.masks.get(dtype)
        if mask is None:
            assert self.decode_slots is not None
            n = len(self.decode_slots)
            mask = torch.zeros(n, self.hi - self.lo + 1, 1, dtype=dtype, device=self.decode_slots.device)
            mask[torch.arange(n), self.decode_slots - self.lo, 0] = 1
            self.masks[dtype] = mask
        return mask

    @property
    def empty(self) -> bool:
        return self.decode_rows is None and not self.groups and self.plan is None

    def without_kernel(self) -> LoraBatch:
        """The same rows for the torch paths (made once)."""
        if self.torch_paths is None:
            self.torch_paths = LoraBatch.of(self.spans, self.device, kernel=False)
        return self.torch_paths

    @classmethod
    def of(cls, spans: list[tuple[int, int, int]], device: torch.device | str, kernel: bool | None = None) -> LoraBatch:
        """From (slot, first row, row count) per sequence of the step, slot 0 for the base model. kernel:
        whether the rows run through the Triton kernels (None: where `use_kernel` says)."""
        batch = cls(spans=spans, device=device)
        if use_kernel(device) if kernel is None else kernel:
            batch.plan = _kernels().plan(spans, device)
            return batch
        rows: list[int] = []
        slots: list[int] = []
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for slot, first, count in spans:
            if slot == 0:
                continue
            if count == 1 and DECODE_PATH != "grouped":
                rows.append(first)
                slots.append(slot)
            else:
                by_slot.setdefault(slot, []).append((first, count))
        batch.dense = DECODE_PATH == "dense"
        if rows:
            batch.decode_rows = torch.tensor(rows, device=device)
            batch.decode_slots = torch.tensor(slots, device=device)
            batch.lo, batch.hi = min(slots), max(slots)
            batch.every_row = rows == list(range(sum(count for _, _, count in spans)))
        for slot, parts in by_slot.items():
            runs: list[list[int]] = []  # [first, count] of each run of adjacent rows
            for first, count in parts:
                if runs and runs[-1][0] + runs[-1][1] == first:
                    runs[-1][1] += count
                else:
                    runs.append([first, count])
            if len(runs) <= MAX_RUNS:  # a product pair per run, on slices of the rows
                batch.groups += [(slot, slice(first, first + count)) for first, count in runs]
            else:  # scattered rows: one product pair over the rows gathered
                index = [r for first, count in runs for r in range(first, first + count)]
                batch.groups.append((slot, torch.tensor(index, device=device)))
        return batch


# an adapter's rows in more runs than this are gathered into one product (the model runner orders a
# step's rows by adapter, so that each adapter's rows are one run, or one per padded decode group)
MAX_RUNS = 2

# the step the forward pass runs (set by the model runner around it); empty: no adapter in the step
ACTIVE: list[LoraBatch] = []


class LoraStack:
    """One projection's adapters, every slot (see the module's docstring)."""

    def __init__(
        self,
        slots: int,
        in_features: int,
        out_sizes: list[int],
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_rank = max_rank
        self.out_sizes = out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        width = len(out_sizes) * max_rank
        self.slots, self.width = slots, width
        self.a = torch.zeros(in_features, slots, width, dtype=dtype, device=device)
        self.b = torch.zeros(slots, width, sum(out_sizes), dtype=dtype, device=device)
        # each slot's A [in, W] and B [W, out], views made once (indexing costs as much as a small product)
        self.a_of = [self.a[:, slot] for slot in range(slots)]
        self.b_of = [self.b[slot] for slot in range(slots)]

    @property
    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def clear(self, slot: int) -> None:
        self.a[:, slot].zero_()
        self.b[slot].zero_()

    def set(self, slot: int, part: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> None:
        """Part `part`'s adapter in `slot`: lora_a [r, in], lora_b [out_part, r] as PEFT stores them."""
        r = lora_a.shape[0]
        cols = slice(part * self.max_rank, part * self.max_rank + r)
        out = slice(self.offsets[part], self.offsets[part] + self.out_sizes[part])
        self.a[:, slot, cols] = lora_a.t().to(self.a.dtype)
        self.b[slot, cols, out] = (lora_b.float().t() * scaling).to(self.b.dtype)

    def image(self, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> tuple[torch.Tensor, ...]:
        """A slot's contents for the adapter whose parts are {part: (lora_a, lora_b)}, built ahead (off the
        engine's loop) so that placing it is two copies: (a [in, W], b [W, out])."""
        a = torch.zeros(self.a.shape[0], self.width, dtype=self.a.dtype)
        b = torch.zeros(self.width, self.b.shape[2], dtype=self.b.dtype)
        for part, (lora_a, lora_b) in parts.items():
            r = lora_a.shape[0]
            cols = slice(part * self.max_rank, part * self.max_rank + r)
            out = slice(self.offsets[part], self.offsets[part] + self.out_sizes[part])
            a[:, cols] = lora_a.t().to(a.dtype)
            b[cols, out] = (lora_b.float().t() * scaling).to(b.dtype)
        return a, b

    def place(self, slot: int, image: tuple[torch.Tensor, ...] | None) -> None:
        """Fill `slot` from an ``image`` (None: clear it)."""
        if image is None:
            self.clear(slot)
            return
        self.a[:, slot].copy_(image[0])
        self.b[slot].copy_(image[1])

    def add_(self, y: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> None:
        """y [T, out] += each adapter row's update from x [T, in]."""
        if batch.plan is not None:
            global KERNEL
            if KERNEL == "auto":
                try:
                    _kernels().add_(y, x, self, batch.plan)
                    return
                except Exception as error:  # a kernel that cannot build or launch here: the torch paths serve
                    log.warning("the LoRA Triton kernels failed (%s); the torch products serve from now on", error)
                    KERNEL = "off"
            batch = batch.without_kernel()
        if batch.decode_rows is not None:
            assert batch.decode_slots is not None
            rows, slots = batch.decode_rows, batch.decode_slots
            xs = x if batch.every_row else x.index_select(0, rows)  # [n, in]
            if batch.dense:
                cols = slice(batch.lo * self.width, (batch.hi + 1) * self.width)
                h = xs @ self.a.view(self.a.shape[0], -1)[:, cols]  # [n, k * W], the slots lo..hi
                if batch.hi > batch.lo:
                    h = (h.view(len(rows), -1, self.width) * batch.mask(h.dtype)).view(len(rows), -1)
                delta = h @ self.b.view(-1, self.b.shape[2])[cols]
            else:
                gathered = self.a.index_select(1, slots).transpose(0, 1)  # [n, in, W]
                delta = torch.bmm(torch.bmm(xs.unsqueeze(1), gathered), self.b.index_select(0, slots)).squeeze(1)
            if batch.every_row:
                y += delta
            else:
                y.index_add_(0, rows, delta)
        for slot, rows_of in batch.groups:
            if isinstance(rows_of, slice):
                y[rows_of].addmm_(x[rows_of] @ self.a_of[slot], self.b_of[slot])
            else:
                y.index_add_(0, rows_of, (x.index_select(0, rows_of) @ self.a_of[slot]) @ self.b_of[slot])


def apply_(y: torch.Tensor, x: torch.Tensor, stack: LoraStack | None) -> torch.Tensor:
    """y plus the step's adapters' updates of the projection `stack` belongs to (in place); y as is
    when the step has no adapter rows or the projection no stack."""
    if ACTIVE and stack is not None:
        stack.add_(y, x, ACTIVE[-1])
    return y
