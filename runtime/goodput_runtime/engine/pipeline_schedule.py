"""The micro-batched pipeline schedule: one step's batch split into micro-batches that flow through
the stages, so that stage s works on micro-batch m while stage s + 1 works on m - 1.

The schedule is GPipe's fill and drain, within each step (forward only: inference has no backward
pass to interleave). Every rank receives the step's items from rank 0 and splits them the same way
(``split``): into up to M contiguous micro-batches of about equal token counts, cutting between
sequences, or inside a prompt chunk where one sequence's tokens dominate the step. Then, on each rank:

- a stage other than the first posts the receives of all M micro-batches' hidden states at once, so
  each lands while the stage is still computing the one before;
- for m = 0 .. M - 1: wait for micro-batch m (stage 0 embeds its tokens), run this stage's layers
  over it, and send the result on without waiting (an asynchronous send), so the stage goes on to
  m + 1 while the next stage runs m;
- the last stage sends each micro-batch's final hidden states (after the final norm) to rank 0;
  rank 0, done with its own M forwards, receives them in order and applies the LM head to each as it
  arrives, while the last stage is still running the later ones.

With P stages and M micro-batches of equal cost t, a step takes (M + P - 1) t instead of M t per
stage, so each stage idles (P - 1) / (M + P - 1) of the step (the bubble): 1/3 at P = M = 2, against
1/2 when the whole batch passes through the stages in turn (M = 1). A micro-batch of sequence
``i`` at stage s only needs its own earlier tokens' KV at stage s, which the same stage wrote before
(micro-batches run in order on every stage), so cutting a prompt chunk in two is exact.

The steps themselves still run one after another: a step's sampled tokens decide the next step's
inputs, and the scheduler plans one step at a time, so the fill and drain are paid again each step.

``GOODPUT_PIPELINE_TRACE=<directory>`` makes every rank append, per step, its compute intervals
(per micro-batch, and rank 0's LM head) to ``<directory>/rank-<r>.jsonl`` on the machine's monotonic
clock: what the tests read to see stages overlap, and the bench to measure the bubble.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from goodput_runtime.engine.pipeline import Topology
from goodput_runtime.engine.step import StepItem
from goodput_runtime.engine.step_inputs import prepare_inputs

TRACE_ENV = "GOODPUT_PIPELINE_TRACE"
MIN_PART = 2  # tokens: a part of a cut prompt chunk of one token would pass for a decode


def splittable(item: StepItem) -> bool:
    """Whether a prompt chunk may be cut between micro-batches: not an embedding (its pooled rows are
    summed whole) nor a speculative proposal."""
    return item.pool is None and item.num_draft == 0 and len(item.token_ids) >= 2 * MIN_PART


def _cut_positions(items: list[StepItem], microbatches: int) -> list[int]:
    """Token offsets into the step where micro-batches begin (after the first): as near as the legal cuts
    allow to equal shares of the step's tokens."""
    edges, total = [0], 0
    interior: list[int] = []
    for item in items:
        n = len(item.token_ids)
        if splittable(item):
            interior.extend(range(total + MIN_PART, total + n - MIN_PART + 1))
        total += n
        edges.append(total)
    legal = sorted(set(edges) | set(interior))
    cuts: list[int] = []
    for k in range(1, microbatches):
        target = total * k / microbatches
        best = min(legal, key=lambda p: (abs(p - target), p))
        if 0 < best < total and (not cuts or best > cuts[-1]):
            cuts.append(best)
    return cuts


def _part(item: StepItem, a: int, b: int) -> StepItem:
    """Tokens [a, b) of a prompt chunk: its prompt-logprob rows among them; it samples only if it ends it."""
    n = len(item.token_ids)
    lo, hi = max(item.prompt_first, a), min(item.prompt_first + item.prompt_count, b)
    return replace(
        item,
        token_ids=item.token_ids[a:b],
        start=item.start + a,
        samples=item.samples and b == n,
        block_copies=[],  # copied once, before the step's first micro-batch
        prompt_first=lo - a if hi > lo else 0,
        prompt_count=max(0, hi - lo),
    )


def split(items: list[StepItem], microbatches: int) -> list[list[tuple[int, StepItem]]]:
    """The step's micro-batches, in order: each a list of (index in items, the item or its part). At
    most `microbatches`, fewer where the step has fewer sequences (and prompt tokens) to share out.
    Concatenated, they are the step's items in order: the rows the LM head keeps come back in the order
    of the whole step's."""
    if microbatches <= 1 or not items:
        return [list(enumerate(items))]
    cuts = _cut_positions(items, microbatches)
    batches: list[list[tuple[int, StepItem]]] = [[]]
    offset = 0  # tokens before the current item
    for index, item in enumerate(items):
        n = len(item.token_ids)
        inside = [c - offset for c in cuts if offset < c < offset + n]
        if offset in cuts and batches[-1]:
            batches.append([])
        if not inside:
            batches[-1].append((index, item))
        else:
            bounds = [0, *inside, n]
            for j, (a, b) in enumerate(itertools.pairwise(bounds)):
                if j:
                    batches.append([])
                batches[-1].append((index, _part(item, a, b)))
        offset += n
    return [b for b in batches if b]


@dataclass
class _Trace:
    """Per step, this rank's compute intervals, one JSON line each, appended to its file."""

    path: Path
    rank: int
    stage: int
    step: int = 0

    def write(self, began: float, records: list[tuple[str, int, int, int, float, float]], microbatches: int) -> None:
        lines = [
            json.dumps(
                {
                    "step": self.step,
                    "rank": self.rank,
                    "stage": self.stage,
                    "what": what,
                    "mb": mb,
                    "microbatches": microbatches,
                    "tokens": tokens,
                    "sequences": sequences,
                    "began": began,
                    "start": start,
                    "end": end,
                }
            )
            for what, mb, tokens, sequences, start, end in records
        ]
        with self.path.open("a") as f:
            f.write("\n".join(lines) + "\n")
        self.step += 1


class MicroBatchSchedule:
    """One rank's part of each step under pipeline parallelism (the module's docstring)."""

    def __init__(self, model: Any, topology: Topology, microbatches: int) -> None:
        self.model = model
        self.inner = model.model
        self.topology = topology
        self.microbatches = microbatches
        self.previous = topology.rank - topology.tensor  # the same tensor rank, one stage before
        self.following = topology.rank + topology.tensor
        self.last_head = (topology.pipeline - 1) * topology.tensor  # tensor rank 0 of the last stage
        embed = self.inner.embed_tokens.weight
        self.hidden_size, self.dtype, self.device = embed.shape[1], embed.dtype, embed.device
        directory = os.environ.get(TRACE_ENV)
        self.trace: _Trace | None = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.trace = _Trace(Path(directory) / f"rank-{topology.rank}.jsonl", topology.rank, topology.stage)

    def _clock(self) -> float:
        if self.trace is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a traced interval ends when its kernels have
        return time.monotonic()

    def _buffer(self, tokens: int) -> torch.Tensor:
        return torch.empty(1, tokens, self.hidden_size, dtype=self.dtype, device=self.device)

    def execute(
        self,
        items: list[StepItem],
        cache: Any,
        block_size: int,
        one_decode_group: bool,
        logits: bool,
        pooled: dict[int, torch.Tensor] | None,
    ) -> torch.Tensor:
        """This rank's share of the step. On rank 0 (``logits``), the logits [N, V] of the rows the
        items keep, in the items' order, and each embedding item's pooled share in `pooled`; elsewhere
        an empty tensor."""
        topology = self.topology
        began = time.monotonic()
        records: list[tuple[str, int, int, int, float, float]] = []  # what, mb, tokens, sequences, start, end
        batches = split(items, self.microbatches)
        inputs = [
            prepare_inputs([item for _, item in batch], cache, block_size, self.device, one_decode_group)
            for batch in batches
        ]
        sizes = [len(ids) for ids, _, _, _ in inputs]
        arriving: list[tuple[Any, torch.Tensor]] = []
        if not topology.first:  # every micro-batch's hidden states received in the background, in order
            for m, n in enumerate(sizes):
                buffer = self._buffer(n)
                arriving.append((dist.irecv(buffer, self.previous, tag=m), buffer))
        sends: list[tuple[Any, torch.Tensor]] = []
        for m, (input_ids, positions, batch, _) in enumerate(inputs):
            if topology.first:
                start = self._clock()
                out = self.inner(input_ids=input_ids[None], position_ids=positions[None], paged=batch, use_cache=False)
            else:
                work, received = arriving[m]
                work.wait()
                start = self._clock()
                out = self.inner(inputs_embeds=received, position_ids=positions[None], paged=batch, use_cache=False)
            hidden = out.last_hidden_state.contiguous()
            records.append(("forward", m, sizes[m], len(batches[m]), start, self._clock()))
            if not topology.last:
                sends.append((dist.isend(hidden, self.following, tag=m), hidden))
            elif topology.rank == self.last_head:
                sends.append((dist.isend(hidden, 0, tag=m), hidden))
        result = torch.empty(0)
        if logits:
            result = self._heads(batches, inputs, sizes, records, pooled)
        for work, _ in sends:
            work.wait()
        if self.trace is not None:
            self.trace.write(began, records, len(batches))
        return result

    def _heads(self, batches, inputs, sizes, records, pooled) -> torch.Tensor:
        """Rank 0: each micro-batch's final hidden states from the last stage, in order, through the LM
        head as they come (the receives are posted only now, after this rank's own sends: under NCCL a
        pair of ranks' transfers run in the order they were posted)."""
        arriving = []
        for m, n in enumerate(sizes):
            buffer = self._buffer(n)
            arriving.append((dist.irecv(buffer, self.last_head, tag=m), buffer))
        pieces: list[torch.Tensor] = []
        for m, (batch_items, (_, _, _, sample_rows)) in enumerate(zip(batches, inputs, strict=True)):
            work, final = arriving[m]
            assert work is not None  # a rank of the group: irecv returns its request
            work.wait()
            start = self._clock()
            hidden = final[0]
            kept = []
            for (index, item), last in zip(batch_items, sample_rows, strict=True):
                kept.extend(item.kept_rows(last))
                if pooled is not None and item.pool == "mean":
                    pooled[index] = hidden[last - len(item.token_ids) + 1 : last + 1].float().sum(0)
                elif pooled is not None and item.pool and item.pool_ends:
                    pooled[index] = hidden[last].float()
            if kept or (m == len(sizes) - 1 and not pieces):  # a step keeping no row still returns one
                rows = torch.tensor(kept or [0], device=self.device)
                pieces.append(self.model.lm_head(hidden[rows]).float())
            records.append(("head", m, sizes[m], len(batch_items), start, self._clock()))
        return torch.cat(pieces)


def read_trace(directory: Path) -> dict[int, list[dict]]:
    """The traced steps (``GOODPUT_PIPELINE_TRACE``) of every rank in `directory`, by step."""
    steps: dict[int, list[dict]] = {}
    for path in sorted(Path(directory).glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                steps.setdefault(record["step"], []).append(record)
    return steps


def decode_only(records: list[dict]) -> bool:
    """Whether a traced step was decodes alone (one token per sequence)."""
    return all(r["tokens"] == r["sequences"] for r in records)


def bubble(steps: list[list[dict]], tensor: int = 1) -> dict[str, float]:
    """Over traced steps: each stage's busy time (its first rank's forwards, and rank 0's LM heads)
    against the steps' span (rank 0's start of the step to the last record's end), and the bubble, the
    share of stage-time left idle: 1 - busy / (stages × span)."""
    span = busy = 0.0
    stages = 0
    for records in steps:
        heads = [r for r in records if r["rank"] % tensor == 0]
        stages = max(stages, 1 + max(r["stage"] for r in heads))
        first = min(r["began"] for r in heads if r["rank"] == 0)
        span += max(r["end"] for r in heads) - first
        busy += sum(r["end"] - r["start"] for r in heads)
    if not span:
        return {"steps": 0, "span_s": 0.0, "busy_s": 0.0, "bubble": 0.0}
    return {"steps": len(steps), "span_s": span, "busy_s": busy, "bubble": 1 - busy / (stages * span)}
