"""The only owner of torch tensors: the model, the KV cache, and one forward pass per step.

A step's inputs are made in step_inputs.py, its prompt logprobs, embeddings and proposals in
step_outputs.py; whole cache blocks are copied by cache_blocks.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from goodput_runtime.engine.cache_blocks import CacheBlocks
from goodput_runtime.engine.contention import ContentionWatch
from goodput_runtime.engine.decode_graphs import MIN_WIDTH, DecodeGraphs
from goodput_runtime.engine.sampler import Sampler, SampleRow
from goodput_runtime.engine.scheduler import SchedulerOutput
from goodput_runtime.engine.spec_decode import Proposer
from goodput_runtime.engine.spec_decode.rejection import SpecGroup, verify
from goodput_runtime.engine.step import KVLayout, StepItem, StepResult, plan_step
from goodput_runtime.engine.step_inputs import lora_batch, lora_order, prepare_inputs
from goodput_runtime.engine.step_outputs import pool, prompt_logprobs, propose
from goodput_runtime.layers import attention, lora
from goodput_runtime.layers.attention import KVCache, PagedBatch
from goodput_runtime.layers.step_plan import StepPlan
from goodput_runtime.models.llama import CausalLM


class ModelRunner(CacheBlocks):
    def __init__(self, model: Any, num_blocks: int, block_size: int, seed: int = 0, tensor_parallel: int = 1) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.block_size = block_size
        self.layout = KVLayout.of(model.config, self.dtype, tensor_parallel)
        # one block more than the block manager hands out: the scratch block that padded decode rows write to
        self.scratch_block = num_blocks
        self.cache = KVCache.allocate(
            self.layout.num_layers,
            (num_blocks + 1) * block_size,
            self.layout.kv_heads,
            self.layout.head_dim,
            self.dtype,
            self.device,
        )
        self.sampler = Sampler(seed)
        # whether a kernel attends decodes (attention.kernel_attends_decodes): then all of a step's
        # decodes form one group, one call per layer; the torch path takes groups of similar context,
        # which spares it padding every row to the longest. Decided at the first step.
        self._one_decode_group: bool | None = None
        # on the leader of a tensor-parallel group: sends each step's plan to the other ranks
        self.broadcast: Callable[[list[StepItem]], object] | None = None
        self.graphs: DecodeGraphs | None = None
        # mean pooling: the float32 sum of the hidden states computed so far, per embedding request
        self.pool_sums: dict[tuple[str, int], torch.Tensor] = {}
        self.proposer: Proposer | None = None  # speculative decoding's: proposes after each step
        # on a CPU, with the runtime's own modules: each step's threads and form of its products
        self.plan: StepPlan | None = None
        # with a plan: steps move to one thread while other processes take the cores (engine/contention.py)
        self.watch: ContentionWatch | None = None
        self.offload: Any = None  # the KV offload tier (engine/kv_offload.py): evicted blocks are saved to it
        # under pipeline parallelism: runs each step as micro-batches through the stages (engine/pipeline_schedule.py)
        self.pipeline = getattr(model, "pipeline_schedule", None)
        if isinstance(model, CausalLM) and self.device.type == "cpu" and tensor_parallel == 1:
            self.set_plan(StepPlan.default(torch.get_num_threads()))

    def set_plan(self, plan: StepPlan) -> None:
        """Run steps as `plan` says (layers/step_plan.py): their threads here, their products' form
        in the model."""
        assert isinstance(self.model, CausalLM)
        self.plan = self.model.model.plan = plan

    def enable_decode_graphs(self, max_batch: int, max_len: int, capture: bool, min_width: int = MIN_WIDTH) -> None:
        """Run decode-only steps over static buffers; with `capture`, replay them as CUDA graphs."""
        self.graphs = DecodeGraphs(
            self._decode_forward,
            self.cache,
            self.block_size,
            self.scratch_block,
            max_batch,
            max_len,
            self.device,
            capture,
            max_tokens=self.scratch_block * self.block_size,
            min_width=min_width,
        )
        self.graphs.capture()

    @torch.inference_mode()
    def warm_up(self, sizes: list[int] | tuple[int, ...] = (1, 2)) -> None:
        """A step of each of `sizes` tokens into the scratch block (no sequence's cache is touched),
        so whatever is compiled lazily is compiled before the first request."""
        for n in sizes:
            table = [self.scratch_block] * max(2, -(-n // self.block_size))
            self.execute([StepItem([0] * n, 0, table, True)])

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, position_ids=positions, paged=batch, logits_to_keep=0, use_cache=False
        ).logits[0]

    def forget(self, request_id: str) -> None:
        """Drop what the runner keeps for a finished request (its sampling generator, a pooling sum)."""
        self.sampler.forget(request_id)
        self.pool_sums.pop((request_id, 0), None)
        if self.proposer is not None:
            self.proposer.forget(request_id)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> StepResult:
        """One forward pass over the scheduled tokens; the sampled tokens (one per sequence, and one
        per choice forking from it), and the logprobs asked for."""
        order, items = plan_step(out)
        if self.broadcast is not None:
            self.broadcast(items)
        if out.kv_saves or out.kv_loads:
            self.transfer_blocks(out.kv_saves, out.kv_loads)
        self._copy_blocks(items)
        logits = self._decode_static(items)  # never with embedding requests: they do not sample
        pooled: dict[int, torch.Tensor] = {}
        if logits is None:
            logits = self.execute(items, copy_blocks=False, pooled=pooled)
        result = StepResult([None] * len(items))
        if pooled:
            pool(out, order, items, pooled, result, self.pool_sums)
        rows: list[SampleRow] = []
        logit_rows: list[int] = []
        targets: list[tuple[int, int]] = []  # (scheduled position, 0 for the sequence or 1 + its fork)
        groups: list[tuple[int, SpecGroup]] = []  # (scheduled position, its proposal's rows)
        prompt_jobs: list[tuple[int, int, list[int], int]] = []  # (position, first row, targets, k)
        at = 0
        for pos, item in zip(order, items, strict=True):
            scheduled = out.scheduled[pos]
            seq = scheduled.seq
            if item.prompt_count:
                span = scheduled.prompt_logprobs
                prompt_jobs.append(
                    (pos, at, seq.token_ids[span.start + 1 : span.stop + 1], seq.params.prompt_logprobs or 0)
                )
                at += item.prompt_count
            if item.samples and item.num_draft:
                draft = item.token_ids[-item.num_draft :]
                row = SampleRow(seq.params, seq.key, seq.token_ids, seq.num_prompt_tokens)
                groups.append((pos, SpecGroup(at, draft, row)))
                at += item.num_draft + 1
            elif item.samples:
                for j, choice in enumerate([seq, *seq.forks]):
                    rows.append(
                        SampleRow(choice.params, choice.key, choice.token_ids, choice.num_prompt_tokens, choice.grammar)
                    )
                    logit_rows.append(at)
                    targets.append((pos, j))
                at += 1
        if prompt_jobs:
            prompt_logprobs(logits, prompt_jobs, result)
        if rows:
            picked = logits if logit_rows == list(range(logits.shape[0])) else logits[logit_rows]
            tokens, logprobs = self.sampler.sample(picked, rows)
            for (pos, j), row, token, logprob in zip(targets, rows, tokens, logprobs, strict=True):
                if j == 0:
                    result.tokens[pos] = token
                else:
                    result.fork_tokens.setdefault(pos, []).append(token)
                if logprob is not None:
                    result.logprobs[row.key] = logprob
        if groups:
            for (pos, group), kept in zip(groups, verify(logits, [g for _, g in groups], self.sampler), strict=True):
                result.tokens[pos], result.accepted[pos] = kept[-1], kept[:-1]
                result.verified.append((len(group.draft), len(kept) - 1))
        if out.speculative and self.proposer is not None:
            propose(self.proposer, out, result)
        return result

    def time_decode(self, batch: int) -> None:
        self.time_step(batch, 1)

    @torch.inference_mode()
    def time_prompt(self, tokens: int) -> None:
        """One forward pass of a `tokens`-token prompt into the scratch block, sampling its last row."""
        table = [self.scratch_block] * (1 + tokens // self.block_size)
        self.execute([StepItem([0] * tokens, 0, table, True)]).argmax(dim=-1).tolist()

    @torch.inference_mode()
    def time_step(self, batch: int, tokens: int) -> None:
        """One forward pass of `batch` sequences of `tokens` new tokens each, sampling every row, into
        the scratch block (no sequence's cache is touched): what speculative decoding's switch times."""
        table = [self.scratch_block] * (2 + tokens // self.block_size)
        items = [StepItem([0] * tokens, self.block_size, table, True, num_draft=tokens - 1) for _ in range(batch)]
        # a plain decode step is timed as it runs when not speculating: replayed from its CUDA graph
        logits = self._decode_static(items) if tokens == 1 else None
        if logits is None:
            logits = self.execute(items)
        logits.argmax(dim=-1).tolist()  # waits for the device

    @torch.inference_mode()
    def execute(
        self,
        items: list[StepItem],
        logits: bool = True,
        copy_blocks: bool = True,
        pooled: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The forward pass: logits [N, V] of the rows the items keep (see StepItem.kept_rows), or
        hidden states without the LM head. With `pooled`, each embedding item's share of this step's
        final hidden states (float32) goes there by its index in items: the sum of its rows for mean
        pooling, its last row for last-token pooling once its prompt is complete."""
        if copy_blocks:
            self._copy_blocks(items)
        if self._one_decode_group is None:
            self._one_decode_group = attention.kernel_attends_decodes(self.cache)
        if self.pipeline is not None:
            return self.pipeline.execute(items, self.cache, self.block_size, self._one_decode_group, logits, pooled)
        # rows of one adapter together (each adapter's product once per run of rows), the items as given
        # for the rest: sample_rows by the items' own order, so the logits keep it
        order = lora_order(items, self._one_decode_group) if logits else None
        run = items if order is None else [items[i] for i in order]
        input_ids, positions, batch, sample_rows = prepare_inputs(
            run, self.cache, self.block_size, self.device, self._one_decode_group
        )
        if self.plan is not None:
            threads = self.plan.threads_for(len(input_ids))
            if self.watch is not None:
                threads = self.watch.begin(threads)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        adapters = lora_batch(run, sample_rows, self.device)
        if order is not None:
            sample_rows = [sample_rows[j] for j in sorted(range(len(order)), key=order.__getitem__)]
        if adapters is not None:
            lora.ACTIVE.append(adapters)
        try:
            return self._forward(items, input_ids, positions, batch, sample_rows, logits, pooled)
        finally:
            if adapters is not None:
                lora.ACTIVE.pop()
            if self.watch is not None:
                self.watch.end()

    def _forward(
        self,
        items: list[StepItem],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: PagedBatch,
        sample_rows: list[int],
        logits: bool,
        pooled: dict[int, torch.Tensor] | None,
    ) -> torch.Tensor:
        kept = [r for last, item in zip(sample_rows, items, strict=True) for r in item.kept_rows(last)]
        keep = torch.tensor(kept or [0], device=self.device)
        if not logits:  # a follower rank: the leader alone samples
            return self.model.model(
                input_ids=input_ids[None], position_ids=positions[None], paged=batch, use_cache=False
            ).last_hidden_state
        if pooled is not None and any(item.pool for item in items):
            # the decoder's output (after its final norm), then the LM head over the kept rows alone:
            # what the model's own forward does with logits_to_keep
            hidden = self.model.model(
                input_ids=input_ids[None], position_ids=positions[None], paged=batch, use_cache=False
            ).last_hidden_state[0]
            for i, (item, last) in enumerate(zip(items, sample_rows, strict=True)):
                if item.pool == "mean":
                    pooled[i] = hidden[last - len(item.token_ids) + 1 : last + 1].float().sum(0)
                elif item.pool and item.pool_ends:
                    pooled[i] = hidden[last].float()
            head = self.model.logits if isinstance(self.model, CausalLM) else self.model.lm_head
            return head(hidden[keep]).float()
        output = self.model(
            input_ids=input_ids[None], position_ids=positions[None], paged=batch, logits_to_keep=keep, use_cache=False
        )
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
        graphs.fill(
            [i.token_ids[0] for i in items],
            [i.start for i in items],
            [i.block_table[i.start // bs] * bs + i.start % bs for i in items],
            [i.block_table for i in items],
            [i.context_len for i in items],
            shape,
        )
        return graphs.run(shape, len(items)).float()
