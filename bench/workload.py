"""A seeded benchmark workload: token-id prompts of exact lengths, output lengths, arrival times.

Prompts are drawn from the model's own vocabulary (special tokens left out), so every
system under test sees the same prompt token count without any re-tokenization, and two
runs with the same seed send byte-identical requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkItem:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float  # offset from the start of the run; 0.0 for an offline batch


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 64
    prompt_len: tuple[int, int] = (16, 256)  # inclusive uniform range, tokens
    output_len: tuple[int, int] = (8, 256)  # inclusive uniform range, tokens
    rate: float = float("inf")  # requests/s of a Poisson process; inf: all at t=0
    seed: int = 0


def parse_range(text: str) -> tuple[int, int]:
    """'16-256' or '128' -> (low, high)."""
    low, _, high = text.partition("-")
    lo, hi = int(low), int(high or low)
    if lo < 1 or hi < lo:
        raise ValueError(f"bad length range {text!r}: want LOW-HIGH with 1 <= LOW <= HIGH")
    return lo, hi


def prompt_vocabulary(tokenizer_dir: str) -> list[int]:
    """Token ids a prompt may use: the whole vocabulary except special and added tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return [i for i in range(len(tokenizer)) if i not in excluded]


def make_workload(spec: WorkloadSpec, vocabulary: list[int]) -> list[WorkItem]:
    # one generator per stream: changing one range or the rate leaves the other streams as they were
    prompt_lengths = random.Random(spec.seed)
    tokens = random.Random(spec.seed + 1)
    arrivals = random.Random(spec.seed + 2)
    output_lengths = random.Random(spec.seed + 3)
    items: list[WorkItem] = []
    clock = 0.0
    for index in range(spec.num_requests):
        prompt_len = prompt_lengths.randint(*spec.prompt_len)
        max_tokens = output_lengths.randint(*spec.output_len)
        prompt = [tokens.choice(vocabulary) for _ in range(prompt_len)]
        if index > 0 and spec.rate != float("inf"):
            clock += arrivals.expovariate(spec.rate)
        items.append(WorkItem(index, prompt, max_tokens, clock))
    return items


def describe(items: list[WorkItem]) -> dict:
    prompts = [len(i.prompt_ids) for i in items]
    outputs = [i.max_tokens for i in items]
    return {
        "num_requests": len(items),
        "prompt_tokens": sum(prompts),
        "prompt_len_min_max": [min(prompts), max(prompts)],
        "output_tokens_wanted": sum(outputs),
        "output_len_min_max": [min(outputs), max(outputs)],
        "last_arrival_s": items[-1].arrival_s,
    }


def window_arrivals(rate: float, window_s: float, seed: int) -> list[float]:
    """Arrival offsets of a seeded Poisson process of `rate` requests/s within [0, `window_s`): open-loop
    traffic, so the count varies from seed to seed as a real minute's would."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    clock = random.Random(seed)
    arrivals: list[float] = []
    t = clock.expovariate(rate)
    while t < window_s:
        arrivals.append(t)
        t += clock.expovariate(rate)
    return arrivals


def items_for(
    lengths: list[tuple[int, int]], arrivals: list[float], vocabulary: list[int], seed: int
) -> list[WorkItem]:
    """WorkItems with the given (prompt tokens, output tokens) and arrival offsets, their prompts seeded
    random token ids from `vocabulary` (so no two requests share a prefix)."""
    if len(lengths) != len(arrivals):
        raise ValueError(f"{len(lengths)} lengths for {len(arrivals)} arrivals")
    tokens = random.Random(seed + 1)
    return [
        WorkItem(index, [tokens.choice(vocabulary) for _ in range(prompt_len)], max_tokens, arrival)
        for index, ((prompt_len, max_tokens), arrival) in enumerate(zip(lengths, arrivals, strict=True))
    ]
