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


def decode_spans(lens: list[int], one_group: bool) -> list[tuple[int, int]]:
    """(first, last) of each padded decode group over decodes of context lengths `lens`, longest first:
    each group holds the decodes from its first on whose context is at least 3/4 of that first one's
    (every decode at once with `one_group`)."""
    spans = []
    first = 0
    while first < len(lens):
        width, last = lens[first], first
        while last < len(lens) and (one_group or lens[last] * 4 >= width * 3):
            last += 1
        spans.append((first, last))
        first = last
    return spans


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
    for first, last in decode_spans([item.context_len for item in decodes], one_decode_group):
        group = decodes[first:last]
        lens = [item.context_len for item in group]
        # the widest row's blocks (plan_step orders decodes longest first: the first row's)
        context = context_blocks([item.block_table for item in group], max(lens), bs, device)
        batch.decodes.append(DecodeGroup(slice(first, last), context, torch.tensor(lens, device=device), bs))
    return (torch.tensor(ids, device=device), torch.tensor(positions, device=device), batch, sample_rows)


def lora_order(items: list[StepItem], one_decode_group: bool) -> list[int] | None:
    """The order to run a step's items in so that the rows of each adapter lie together: the decodes
    first, each padded decode group (decode_spans) kept as it is but its rows ordered by adapter, the
    slot of its longest row first (so the groups stay the same); then the prompt chunks, by adapter.
    None when the step has no adapter rows or is already so ordered. A stable sort: the rows of one
    adapter keep their order."""
    if not any(item.lora_slot for item in items):
        return None
    decodes = [i for i, item in enumerate(items) if len(item.token_ids) == 1]
    if decodes != list(range(len(decodes))):
        return None  # not decodes first (prepare_inputs' own layout): left as it is
    order: list[int] = []
    for first, last in decode_spans([items[i].context_len for i in decodes], one_decode_group):
        lead = items[first].lora_slot
        order += sorted(range(first, last), key=lambda i: (items[i].lora_slot != lead, items[i].lora_slot))
    order += sorted(range(len(decodes), len(items)), key=lambda i: items[i].lora_slot)
    return None if order == list(range(len(items))) else order


def lora_batch(items: list[StepItem], sample_rows: list[int], device: torch.device) -> lora.LoraBatch | None:
    """The step's rows on LoRA adapters by slot (layers/lora.py); None when every row is the base model's."""
    if not any(item.lora_slot for item in items):
        return None
    spans = [
        (item.lora_slot, last - len(item.token_ids) + 1, len(item.token_ids))
        for item, last in zip(items, sample_rows, strict=True)
    ]
    return lora.LoraBatch.of(spans, device)
