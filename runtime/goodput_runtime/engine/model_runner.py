"""The only owner of torch tensors: the model, the KV cache, and one forward pass per step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from goodput_runtime.engine.attention import DecodeGroup, KVCache, PagedBatch, PrefillChunk
from goodput_runtime.engine.decode_graphs import MIN_WIDTH, DecodeGraphs
from goodput_runtime.engine.sampler import Sampler
from goodput_runtime.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    kv_heads: int  # on this rank: the model's KV heads divided by the tensor-parallel size
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model_config, dtype: torch.dtype, tensor_parallel: int = 1) -> KVLayout:
        heads = model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        return cls(model_config.num_hidden_layers, kv_heads // tensor_parallel, head_dim, dtype)

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()


@dataclass(slots=True)
class StepItem:
    """One sequence's share of a step, in plain Python so it can be sent to other ranks."""

    token_ids: list[int]  # the tokens computed this step
    start: int  # tokens already in the cache
    block_table: list[int]
    samples: bool

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


def plan_step(out: SchedulerOutput) -> tuple[list[int], list[StepItem]]:
    """The step's items, decodes first and longest context first, so similar lengths share a padded
    attention batch; with the scheduled position of each."""
    scheduled = out.scheduled
    # by the context the step attends to (a one-token prefill chunk is a decode of a short context)
    order = sorted(range(len(scheduled)),
                   key=lambda i: (scheduled[i].num_tokens != 1, -(scheduled[i].start + scheduled[i].num_tokens)))
    items = []
    for i in order:
        s = scheduled[i]
        tokens = s.seq.token_ids[s.start : s.start + s.num_tokens]
        items.append(StepItem(tokens, s.start, list(s.seq.block_table), s.samples))
    return order, items


class ModelRunner:
    def __init__(self, model: Any, num_blocks: int, block_size: int, seed: int = 0,
                 tensor_parallel: int = 1) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.block_size = block_size
        self.layout = KVLayout.of(model.config, self.dtype, tensor_parallel)
        # one block more than the block manager hands out: the scratch block that padded decode rows write to
        self.scratch_block = num_blocks
        self.cache = KVCache.allocate(self.layout.num_layers, (num_blocks + 1) * block_size, self.layout.kv_heads,
                                      self.layout.head_dim, self.dtype, self.device)
        self.sampler = Sampler(seed)
        # on the leader of a tensor-parallel group: sends each step's plan to the other ranks
        self.broadcast: Callable[[list[StepItem]], object] | None = None
        self.graphs: DecodeGraphs | None = None

    @torch.inference_mode()
    def enable_decode_graphs(self, max_batch: int, max_len: int, capture: bool, min_width: int = MIN_WIDTH) -> None:
        """Run decode-only steps over static buffers; with `capture`, replay them as CUDA graphs."""
        self.graphs = DecodeGraphs(self._decode_forward, self.cache, self.block_size, self.scratch_block,
                                   max_batch, max_len, self.device, capture,
                                   max_tokens=self.scratch_block * self.block_size, min_width=min_width)
        self.graphs.capture()

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=positions, paged=batch, logits_to_keep=0,
                          use_cache=False).logits[0]

    def forget(self, request_id: str) -> None:
        """Drop what the runner keeps for a finished request (its sampling generator)."""
        self.sampler.forget(request_id)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> list[int | None]:
        """One forward pass over the scheduled tokens; the sampled token per sequence, None mid-prefill."""
        order, items = plan_step(out)
        if self.broadcast is not None:
            self.broadcast(items)
        logits = self._decode_static(items)
        if logits is None:
            logits = self.execute(items)
        result: list[int | None] = [None] * len(items)
        sampling = [(pos, out.scheduled[pos].seq) for pos, item in zip(order, items, strict=True) if item.samples]
        if not sampling:
            return result
        tokens = self.sampler.sample(logits, [seq.params for _, seq in sampling],
                                     [seq.request_id for _, seq in sampling])
        for (pos, _), token in zip(sampling, tokens, strict=True):
            result[pos] = token
        return result

    @torch.inference_mode()
    def execute(self, items: list[StepItem], logits: bool = True) -> torch.Tensor:
        """The forward pass: logits [N, V] of the sampling rows, or hidden states without the LM head."""
        input_ids, positions, batch, sample_rows = self._prepare(items)
        keep = torch.tensor([r for r, item in zip(sample_rows, items, strict=True) if item.samples] or [0],
                            device=self.device)
        if not logits:  # a follower rank: the leader alone samples
            return self.model.model(input_ids=input_ids[None], position_ids=positions[None], paged=batch,
                                    use_cache=False).last_hidden_state
        output = self.model(input_ids=input_ids[None], position_ids=positions[None], paged=batch,
                            logits_to_keep=keep, use_cache=False)
        return output.logits[0].float()  # [N, V]

    def _decode_static(self, items: list[StepItem]) -> torch.Tensor | None:
        """Logits of a decode-only step from the static path, or None where it does not apply."""
        graphs = self.graphs
        if graphs is None or not items or any(len(i.token_ids) != 1 or not i.samples for i in items):
            return None
        shape = graphs.shape_for(len(items), max(i.context_len for i in items))
        if shape is None:
            return None
        bs = self.block_size
        graphs.fill([i.token_ids[0] for i in items], [i.start for i in items],
                    [i.block_table[i.start // bs] * bs + i.start % bs for i in items],
                    [i.block_table for i in items], [i.context_len for i in items], shape)
        return graphs.run(shape, len(items)).float()

    def _context_slots(self, tables: list[list[int]], width: int) -> torch.Tensor:
        """[B * width] cache slots of the first `width` positions of each block table."""
        bs = self.block_size
        blocks = -(-width // bs)
        padded = torch.tensor([t[:blocks] + [0] * (blocks - len(t[:blocks])) for t in tables], device=self.device)
        slots = padded[:, :, None] * bs + torch.arange(bs, device=self.device)
        return slots.view(len(tables), -1)[:, :width].reshape(-1)

    def _prepare(self, items: list[StepItem]):
        bs = self.block_size
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
                chunk_slots = self._context_slots([table], start + n) if start else None
                prefills.append(PrefillChunk(slice(row, row + n), start, chunk_slots))
        batch = PagedBatch(self.cache, torch.tensor(slots, device=self.device), prefills=prefills)
        first = 0
        while first < len(decodes):
            width = decodes[first].context_len
            last = first
            while last < len(decodes) and decodes[last].context_len * 4 >= width * 3:
                last += 1
            group = decodes[first:last]
            lens = torch.tensor([item.context_len for item in group], device=self.device)
            context = self._context_slots([item.block_table for item in group], width)
            batch.decodes.append(DecodeGroup(slice(first, last), context, lens, width))
            first = last
        return (torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                batch, sample_rows)
