"""An independent reference for what the sampler reports: transformers' logits, processed one token
at a time with plain Python loops, in the order vLLM applies them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


class Reference:
    def __init__(self, model_dir: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), V] float32 logits of transformers' own forward pass."""
        with torch.inference_mode():
            return self.model(input_ids=torch.tensor([token_ids])).logits[0].float()

    @staticmethod
    def processed(
        row: torch.Tensor,
        prompt: list[int],
        output: list[int],
        *,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        min_tokens: int = 0,
        stop_ids: tuple[int, ...] = (),
        temperature: float = 0.0,
    ) -> torch.Tensor:
        """log_softmax of one position's logits after bias, minimum length, penalties and temperature."""
        x = row.clone()
        for token, bias in (logit_bias or {}).items():
            x[token] += max(-100.0, min(100.0, bias))
        if len(output) < min_tokens:
            for token in stop_ids:
                x[token] = float("-inf")
        for token in set(prompt) | set(output):
            x[token] = x[token] / repetition_penalty if x[token] > 0 else x[token] * repetition_penalty
        for token, count in Counter(output).items():
            x[token] -= frequency_penalty * count + presence_penalty
        if temperature:
            x = x / temperature
        return x.log_softmax(-1)

    def greedy(self, prompt: list[int], max_tokens: int, **settings) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding over the processed logits; the tokens and each step's logprobs."""
        output: list[int] = []
        steps = []
        for _ in range(max_tokens):
            logprobs = self.processed(self.logits(prompt + output)[-1], prompt, output, **settings)
            steps.append(logprobs)
            output.append(int(logprobs.argmax()))
        return output, steps
