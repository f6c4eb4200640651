"""The only owner of torch tensors: the model, the KV cache, and one forward pass per step."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from goodput_runtime.engine.attention import DecodeGroup, KVCache, PagedBatch, PrefillChunk
from goodput_runtime.engine.sampler import Sampler
from goodput_runtime.engine.scheduler import ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model_config, dtype: torch.dtype) -> KVLayout:
        heads = model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        return cls(model_config.num_hidden_layers, kv_heads, head_dim, dtype)

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.layout = KVLayout.of(model.config, self.dtype)
        self.cache = KVCache.allocate(self.layout.num_layers, num_blocks * block_size, self.layout.kv_heads,
                                      self.layout.head_dim, self.dtype, self.device)
        self.sampler = Sampler(seed)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> list[int | None]:
        """One forward pass over the scheduled tokens; the sampled token per sequence, None mid-prefill."""
        # decodes first, longest context first, so similar lengths share a padded attention batch
        order = sorted(range(len(out.scheduled)),
                       key=lambda i: (out.scheduled[i].num_tokens != 1, -out.scheduled[i].seq.num_tokens))
        items = [out.scheduled[i] for i in order]
        input_ids, positions, batch, sample_rows = self._prepare(items)
        sampling = [(row, item) for row, item in zip(sample_rows, items, strict=True) if item.samples]
        result: list[int | None] = [None] * len(items)
        keep = torch.tensor([row for row, _ in sampling] or [0], device=self.device)
        logits = self._forward(input_ids, positions, batch, keep)
        if not sampling:
            return result
        tokens = self.sampler.sample(logits, [item.seq.params for _, item in sampling],
                                     [item.seq.request_id for _, item in sampling])
        sampled = iter(tokens)
        for pos, item in zip(order, items, strict=True):
            if item.samples:
                result[pos] = next(sampled)
        return result

    def _forward(self, input_ids, positions, batch: PagedBatch, keep: torch.Tensor) -> torch.Tensor:
        output = self.model(input_ids=input_ids[None], position_ids=positions[None], paged=batch,
                            logits_to_keep=keep, use_cache=False)
        return output.logits[0].float()  # [N, V]

    def _context_slots(self, tables: list[list[int]], width: int) -> torch.Tensor:
        """[B * width] cache slots of the first `width` positions of each block table."""
        bs = self.block_size
        blocks = -(-width // bs)
        padded = torch.tensor([t[:blocks] + [0] * (blocks - len(t[:blocks])) for t in tables], device=self.device)
        slots = padded[:, :, None] * bs + torch.arange(bs, device=self.device)
        return slots.view(len(tables), -1)[:, :width].reshape(-1)

    def _prepare(self, items: list[ScheduledSeq]):
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        decode_rows: list[ScheduledSeq] = []
        prefills: list[PrefillChunk] = []
        for item in items:
            seq, start, n = item.seq, item.start, item.num_tokens
            table = seq.block_table
            row = len(ids)
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            sample_rows.append(row + n - 1)
            if n == 1:
                decode_rows.append(item)
            else:
                chunk_slots = self._context_slots([table], start + n) if start else None
                prefills.append(PrefillChunk(slice(row, row + n), start, chunk_slots))
        batch = PagedBatch(self.cache, torch.tensor(slots, device=self.device), prefills=prefills)
        first = 0
        while first < len(decode_rows):
            width = decode_rows[first].seq.num_tokens
            last = first
            while last < len(decode_rows) and decode_rows[last].seq.num_tokens * 4 >= width * 3:
                last += 1
            group = decode_rows[first:last]
            lens = torch.tensor([item.seq.num_tokens for item in group], device=self.device)
            context = self._context_slots([item.seq.block_table for item in group], width)
            batch.decodes.append(DecodeGroup(slice(first, last), context, lens, width))
            first = last
        return (torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                batch, sample_rows)
