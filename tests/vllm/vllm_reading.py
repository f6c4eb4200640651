"""What the clients timed and what vLLM's /metrics say, for tests/vllm/test_vllm_engine.py."""

from __future__ import annotations

import time

import pytest
from openai import AsyncOpenAI


class Client:
    """Concurrent streaming completions, each timed by the client."""

    def __init__(self, url: str) -> None:
        self.openai = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        self.in_flight = 0
        self.results: list[dict] = []

    async def one(self, prompt: str, tokens: int) -> None:
        self.in_flight += 1
        start = time.monotonic()
        times = []
        usage = None
        try:
            stream = await self.openai.completions.create(
                model="smollm2",
                prompt=prompt,
                max_tokens=tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    times.append(time.monotonic())
                if chunk.usage:
                    usage = chunk.usage
        finally:
            self.in_flight -= 1
        assert usage is not None and usage.completion_tokens == tokens
        ttft = times[0] - start
        tpot = (times[-1] - times[0]) / (tokens - 1)
        self.results.append({"ttft": ttft, "tpot": tpot, "prompt_tokens": usage.prompt_tokens})


def sample(text: str, name: str):
    """The first sample called `name` in an exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    found = (x for family in text_string_to_metric_families(text) for x in family.samples if x.name == name)
    return next(found, None) or pytest.fail(f"no {name} in vLLM's /metrics")


def cache_config(text: str) -> tuple[int, int]:
    """(usable KV blocks, tokens per block) from vllm:cache_config_info; one block of the pool is vLLM's
    null block, left out of its usage ratio."""
    labels = sample(text, "vllm:cache_config_info").labels
    return int(labels["num_gpu_blocks"]) - 1, int(labels["block_size"])


def ttft_sum(text: str) -> float:
    """vLLM's running total of the first-token times it measured (its TTFT histogram's sum)."""
    return float(sample(text, "vllm:time_to_first_token_seconds_sum").value)
