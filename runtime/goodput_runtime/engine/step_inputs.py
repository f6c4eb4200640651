"""A step's model inputs, made from its items: token ids, positions, the cache slots they write, the
paged attention batch (prefill chunks, decode groups), and the rows on LoRA adapters."""

from __future__ import annotations

import torch

from goodput_runtime.engine.step import StepItem
from goodput_runtime.layers import lora
from goodput_runtime.layers.attention import DecodeGroup, KVCache, PagedBatch, PrefillChunk


def context_blocks(tables: list[list[int]], width: int, block_size: int, device: torch.device) -> torch.Tensor:
    """[B, blocks] the blocks holding the first `width` positions of each block table (padded with 0)."""
    blocks = -(-width // block_size)
    return torch.tensor([t[:blocks] + [0] * (blocks - len(t[:blocks])) for t in tables], device=device)


def context_slots(tables: list[list[int]], width: int, block_size: int, device: torch.device) -> torch.Tensor:
    """[B * width] cache slots of the first `width` positions of each block table."""
    bs = block_size
    slots = context_blocks(tables, width, bs, device)[:, :, None] * bs + torch.arange(bs, device=device)
    return slots.view(len(tables), -1)[:, :width].reshape(-1)


def prepare_inputs(
    items: list[StepItem], cache: KVCache, block_size: int, device: torch.device, one_decode_group: bool
) -> tuple[torch.Tensor, torch.Tensor, PagedBatch, list[int]]:
    """Input ids [N], positions [N], the paged batch, and each item's last row. With
    `one_decode_group`, all decodes form one group; else groups of similar context."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    decodes: list[StepItem] = []
    prefills: list[PrefillChunk] = []
    for item in items:
        start, n, table = item.start, len(item.token_ids), item.block_table
        row = len(ids)
        ids.extend(item.token_ids)
        positions.extend(range(start, start + n))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        sample_rows.append(row + n - 1)
        if n == 1:
            decodes.append(item)
        else:
            chunk_slots = context_slots([table], start + n, bs, device) if start else None
            prefills.append(PrefillChunk(slice(row, row + n), start, chunk_slots))
    batch = PagedBatch(cache, torch.tensor(slots, device=device), prefills=prefills)
    first = 0
    while first < len(decodes):
        width = decodes[first].context_len
        last = first
        while last < len(decodes) and (one_decode_group or decodes[last].context_len * 4 >= width * 3):
            last += 1
        group = decodes[first:last]
        lens = [item.context_len for item in group]
        # the widest row's blocks (plan_step orders decodes longest first: the first row's)
        context = context_blocks([item.block_table for item in group], max(lens), bs, device)
        batch.decodes.append(DecodeGroup(slice(first, last), context, torch.tensor(lens, device=device), bs))
        first = last
    return (torch.tensor(ids, device=device), torch.tensor(positions, device=device), batch, sample_rows)


def lora_batch(items: list[StepItem], sample_rows: list[int], device: torch.device) -> lora.LoraBatch | None:
    """The step's rows on LoRA adapters by slot (layers/lora.py); None when every row is the base model's."""
    if not any(item.lora_slot for item in items):
        return None
    spans = [
        (item.lora_slot, last - len(item.token_ids) + 1, len(item.token_ids))
        for item, last in zip(items, sample_rows, strict=True)
    ]
    return lora.LoraBatch.of(spans, device)
