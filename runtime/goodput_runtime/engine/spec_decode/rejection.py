"""Verification of proposed tokens against the target model's logits.

A speculating sequence has k + 1 logit rows: row i predicts the token after its i-th proposed
token (row 0 the token after its last real one). Greedy requests keep the longest prefix of the
proposal equal to the target's argmax, then the argmax after it: exactly what decoding one token
at a time gives.

Sampled requests use rejection sampling (Leviathan et al., 2023; Chen et al., 2023). Proposals
here are deterministic (prompt lookup, or the draft model's argmax), so the proposal distribution
q is one-hot on the proposed token d: d is accepted with probability min(1, p(d) / q(d)) = p(d),
and after a rejection the token is drawn from the residual max(0, p - q), which is p with d
removed. Either way each kept token has the target's distribution p, the one the sampler draws
from (temperature, min-p, top-k, top-p); when every proposal is accepted one more token is drawn
from the last row. Seeded requests take their uniforms and draws from their own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from goodput_runtime.engine.sampler import Sampler, SampleRow, row_argmax


@dataclass(slots=True)
class SpecGroup:
    """One speculating sequence's share of the step's logits."""

    first: int  # its first logit row
    draft: list[int]  # the k proposed tokens
    row: SampleRow

    @property
    def rows(self) -> range:
        return range(self.first, self.first + len(self.draft) + 1)


def verify(logits: torch.Tensor, groups: list[SpecGroup], sampler: Sampler) -> list[list[int]]:
    """Per group, the tokens it keeps: the accepted prefix of its proposal, then one of the
    target's. logits: [N, V] float32, holding every group's rows."""
    kept: list[list[int]] = [[] for _ in groups]
    greedy = [i for i, g in enumerate(groups) if g.row.params.greedy]
    if greedy:
        index = torch.tensor([r for i in greedy for r in groups[i].rows], device=logits.device)
        best = row_argmax(logits[index]).tolist()
        at = 0
        for i in greedy:
            group = groups[i]
            target = best[at : at + len(group.draft) + 1]
            at += len(target)
            n = 0
            while n < len(group.draft) and group.draft[n] == target[n]:
                n += 1
            kept[i] = [*group.draft[:n], target[n]]
    sampled = [i for i, g in enumerate(groups) if not g.row.params.greedy]
    if sampled:
        for i, tokens in zip(sampled, _rejection_sample(logits, [groups[i] for i in sampled], sampler), strict=True):
            kept[i] = tokens
    return kept


def _rejection_sample(logits: torch.Tensor, groups: list[SpecGroup], sampler: Sampler) -> list[list[int]]:
    device = logits.device
    index = torch.tensor([r for g in groups for r in g.rows], device=device)
    params = [g.row.params for g in groups for _ in g.rows]
    temperatures = torch.tensor([p.temperature for p in params], device=device)[:, None]
    probs = Sampler.probabilities(logits[index] / temperatures, params)
    probs = probs / probs.sum(dim=-1, keepdim=True)  # [R, V]: the target's distribution per row
    starts = [0]
    for g in groups:
        starts.append(starts[-1] + len(g.draft) + 1)
    draft_rows = [starts[i] + j for i, g in enumerate(groups) for j in range(len(g.draft))]
    drafted = [t for g in groups for t in g.draft]
    accept = probs[torch.tensor(draft_rows, device=device), torch.tensor(drafted, device=device)]
    uniforms = _random(
        groups, sampler, device, lambda g: len(g.draft), lambda n, gen: torch.rand(n, generator=gen, device=device)
    )
    rejected = (uniforms >= accept).tolist()
    kept_counts = []
    at = 0
    for g in groups:
        flags = rejected[at : at + len(g.draft)]
        at += len(g.draft)
        kept_counts.append(flags.index(True) if True in flags else len(g.draft))
    last = probs[torch.tensor([starts[i] + n for i, n in enumerate(kept_counts)], device=device)]  # [G, V]
    residual = [(i, g.draft[n]) for i, (g, n) in enumerate(zip(groups, kept_counts, strict=True)) if n < len(g.draft)]
    if residual:  # max(0, p - q) for a one-hot q: p without the rejected token
        last[[i for i, _ in residual], [t for _, t in residual]] = 0.0
    vocab = last.shape[1]
    noise = _random(
        groups,
        sampler,
        device,
        lambda g: vocab,
        lambda n, gen: torch.empty(n, device=device).exponential_(generator=gen),
    ).view(len(groups), vocab)
    drawn = row_argmax(last / noise).tolist()
    return [[*g.draft[:n], t] for g, n, t in zip(groups, kept_counts, drawn, strict=True)]


def _random(groups: list[SpecGroup], sampler: Sampler, device: torch.device, size, draw) -> torch.Tensor:
    """size(group) random numbers per group, concatenated: a seeded request's from its own generator,
    the others' from the sampler's shared one in one draw."""
    sizes = [size(g) for g in groups]
    unseeded = [i for i, g in enumerate(groups) if g.row.params.seed is None]
    shared = draw(sum(sizes[i] for i in unseeded), sampler._shared(device)) if unseeded else None
    parts: list[torch.Tensor] = []
    at = 0
    for i, g in enumerate(groups):
        if g.row.params.seed is None:
            assert shared is not None
            parts.append(shared[at : at + sizes[i]])
            at += sizes[i]
        else:
            parts.append(draw(sizes[i], sampler._generator(g.row, device)))
    return torch.cat(parts) if parts else torch.empty(0, device=device)
