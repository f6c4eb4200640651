"""What a step returns besides its sampled tokens: prompt logprobs, embedding vectors, and the
proposals for the next step."""

from __future__ import annotations

import torch

from goodput_runtime.engine.sampler import logprob_rows
from goodput_runtime.engine.scheduler import SchedulerOutput
from goodput_runtime.engine.spec_decode import Proposer, can_speculate
from goodput_runtime.engine.step import StepItem, StepResult


def prompt_logprobs(logits: torch.Tensor, jobs: list[tuple[int, int, list[int], int]], result: StepResult) -> None:
    """Each prompt row's logprob of the prompt token after it, all jobs in one batch."""
    index = [first + i for _, first, targets, _ in jobs for i in range(len(targets))]
    chosen = torch.tensor([t for _, _, targets, _ in jobs for t in targets], device=logits.device)
    ks = [k for _, _, targets, k in jobs for _ in targets]
    entries = logprob_rows(logits[index], chosen, ks)
    at = 0
    for pos, _, targets, _ in jobs:
        result.prompt_logprobs[pos] = entries[at : at + len(targets)]
        at += len(targets)


def pool(
    out: SchedulerOutput,
    order: list[int],
    items: list[StepItem],
    pooled: dict[int, torch.Tensor],
    result: StepResult,
    sums: dict[tuple[str, int], torch.Tensor],
) -> None:
    """Fold this step's pooled hidden states into each embedding request's (mean pooling's running
    `sums`); a request whose prompt is complete gets its vector (normalized if asked) in result.embeddings."""
    for i, part in pooled.items():
        item, seq = items[i], out.scheduled[order[i]].seq
        assert seq.pooling is not None
        vector = part
        if item.pool == "mean":
            # a prompt restarts at position 0 after a preemption: whatever was summed is dropped
            if item.start:
                vector = sums.pop(seq.key) + part
            if not item.pool_ends:
                sums[seq.key] = vector
                continue
            vector = vector / seq.num_prompt_tokens
        if seq.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
        result.embeddings[seq.key] = vector.cpu().tolist()


def propose(proposer: Proposer, out: SchedulerOutput, result: StepResult) -> None:
    """Proposals for the next step of every sequence that got a token and may speculate."""
    wanted: list[tuple[int, tuple[tuple[str, int], list[int]]]] = []
    for pos, token in enumerate(result.tokens):
        seq = out.scheduled[pos].seq
        if token is not None and not seq.is_finished and can_speculate(seq.params, seq):
            wanted.append((pos, (seq.key, [*seq.token_ids, *result.accepted.get(pos, []), token])))
    if not wanted:
        return
    for (pos, _), draft in zip(wanted, proposer.propose([w for _, w in wanted]), strict=True):
        if draft:
            result.proposals[pos] = draft
