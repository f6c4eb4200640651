"""A runtime whose KV cache is far too small for its load preempts and recomputes: it neither
crashes nor loses a request.

A real `python -m goodput_runtime` process gets a KV cache of 320 tokens (20 blocks) while 24
clients of the official `openai` SDK ask at once for 64 tokens each after a ~40-token prompt:
about 2,500 tokens of demand, nearly eight times the cache. Every request must come back 200
with all 64 tokens, the same greedy tokens the runtime gives the prompt alone (so
recomputation after preemption loses nothing), the runtime must have preempted to get there,
and afterwards it still answers /health with every KV block free again.

Prints one `FAULT-ROW {json}` line, which bench/faults.py collects into its table.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

pytestmark = pytest.mark.faults

CLIENTS = 24
MAX_TOKENS = 64
KV_TOKENS = 320
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head dim 16, fp32: the tiny model


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = [float(m[1]) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)]
    assert values, f"no {name} on /metrics"
    return sum(values)


def prompt(i: int) -> str:
    words = ["river", "stone", "cloud", "lamp", "orchard", "harbor", "violet", "engine", "quiet", "signal"]
    return " ".join(words[(i * 7 + k) % len(words)] for k in range(24 + i % 9))


def test_a_kv_cache_far_too_small_preempts_and_recomputes_without_losing_a_request(runtime):
    server = runtime(
        "--max-model-len",
        "256",
        "--block-size",
        "16",
        "--kv-cache-memory",
        str(KV_TOKENS * BYTES_PER_TOKEN),
        "--max-num-seqs",
        "16",
    )
    server.wait_for_log(r"Ready: serving", timeout=120)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(i: int) -> tuple[str, int]:
        completion = client.completions.create(
            model="tiny", prompt=prompt(i), max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        return completion.choices[0].text, completion.usage.completion_tokens

    started = time.monotonic()
    failures: list[str] = []
    answers: dict[int, tuple[str, int]] = {}
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = {i: pool.submit(ask, i) for i in range(CLIENTS)}
        for i, future in futures.items():
            try:
                answers[i] = future.result()
            except openai.APIError as err:
                failures.append(f"request {i}: {err}")
    drained = time.monotonic() - started

    assert server.process.poll() is None, f"the runtime exited under KV pressure:\n{server.log()[-4000:]}"
    assert not failures, failures
    assert all(tokens == MAX_TOKENS for _, tokens in answers.values()), answers
    preemptions = metric(server.url, "goodput_preemptions_total")
    assert preemptions > 0, "the cache was large enough: nothing was preempted"

    # alone, with the whole cache to itself, each prompt gets the same greedy tokens
    for i in (0, 5, 11, 23):
        assert ask(i) == answers[i], f"request {i} came out different under preemption"
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as response:
        assert response.status == 200
    assert metric(server.url, "goodput_kv_cache_usage_ratio") == 0.0
    print(
        "FAULT-ROW "
        + json.dumps(
            {
                "fault": f"KV cache of {KV_TOKENS} tokens under {CLIENTS} concurrent requests (~8x its size)",
                "tier": "runtime",
                "requests": CLIENTS,
                "failed": len(failures),
                "retried": 0,
                "converge_s": round(drained, 1),
                "preemptions": int(preemptions),
            }
        )
    )
