"""Next-token choice from logits: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from goodput_runtime.sampling import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.shared: dict[torch.device, torch.Generator] = {}
        self.seeded: dict[str, torch.Generator] = {}  # request id -> its own generator

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]) -> list[int]:
        # logits: [N, V]
        tokens = logits.argmax(dim=-1).tolist()
        for row, (p, request_id) in enumerate(zip(params, request_ids, strict=True)):
            if not p.greedy:
                tokens[row] = self._draw(logits[row], p, self._generator(request_id, p, logits.device))
        return tokens

    def forget(self, request_id: str) -> None:
        self.seeded.pop(request_id, None)

    def _generator(self, request_id: str, p: SamplingParams, device: torch.device) -> torch.Generator:
        if p.seed is None:
            if device not in self.shared:
                self.shared[device] = torch.Generator(device=device).manual_seed(self.seed)
            return self.shared[device]
        if request_id not in self.seeded:
            self.seeded[request_id] = torch.Generator(device=device).manual_seed(p.seed)
        return self.seeded[request_id]

    @staticmethod
    def _draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
        # logits: [V]
        scores = logits.float() / p.temperature
        if p.top_k > 0 and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_scores.softmax(-1) >= p.top_p  # keep the token that crosses top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = scores.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=generator).item())
