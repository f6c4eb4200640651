"""Tensor parallelism on CPU (gloo): two ranks give one rank's greedy tokens, and fail loudly."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import aiohttp

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.sampling import SamplingParams

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # the tiny model's KV bytes per token, fp32


def workload(n: int = 10) -> list[tuple[list[int], int]]:
    shared = [(i * 37) % 900 + 5 for i in range(30)]
    cases = []
    for i in range(n):
        tail = [(i * 53 + j * 11) % 900 + 5 for j in range(3 + (i * 7) % 40)]
        cases.append(((shared if i % 3 == 0 else []) + tail, 6 + (i * 13) % 30))
    return cases


def run_staggered(core, cases) -> list[list[int]]:
    """Two new requests every other step, so they join a running batch; every request's tokens."""
    produced = {str(i): [] for i in range(len(cases))}
    pending = list(enumerate(cases))
    steps = 0
    while pending or core.has_unfinished():
        if steps % 2 == 0:
            for i, (prompt, max_tokens) in pending[:2]:
                core.add(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            pending = pending[2:]
        for out in core.step():
            produced[out.request_id].extend(out.token_ids)
        steps += 1
    return [produced[str(i)] for i in range(len(cases))]


def config(model_dir, tensor_parallel: int) -> EngineConfig:
    # a cache small enough to preempt, a budget small enough to chunk prefills
    return EngineConfig(
        model=str(model_dir),
        block_size=4,
        kv_cache_memory=48 * 4 * BYTES_PER_TOKEN,
        max_model_len=128,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        tensor_parallel_size=tensor_parallel,
    )


def test_two_ranks_produce_the_single_rank_greedy_tokens(tiny_model_dir):
    cases = workload()
    expected = run_staggered(build_core(config(tiny_model_dir, 1)), cases)
    metrics = RuntimeMetrics("tiny", None, None)
    core = build_core(config(tiny_model_dir, 2), metrics)
    try:
        assert core.runner.layout.kv_heads == 1  # the KV cache is split by KV heads
        produced = run_staggered(core, cases)
    finally:
        core.close()
    assert produced == expected
    assert metrics.preemptions._value.get() > 0
    assert metrics.prefix_hits._value.get() > 0


def follower_pids(server_pid: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(server_pid), "-f", "goodput_runtime.engine.tp_worker"], capture_output=True, text=True
    )
    return [int(p) for p in out.stdout.split()]


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with http.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_a_two_rank_server_answers_concurrent_requests_and_exits_0_on_sigterm(runtime, tiny_model_dir):
    server = runtime("--tensor-parallel-size", "2")
    cases = workload(6)
    single = build_core(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=2 << 20, max_model_len=2048))
    for i, (prompt, max_tokens) in enumerate(cases):
        single.add(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    texts = {str(i): "" for i in range(len(cases))}
    while single.has_unfinished():
        for out in single.step():
            texts[out.request_id] += out.text
    expected = [texts[str(i)] for i in range(len(cases))]
    async with aiohttp.ClientSession() as http:
        await server.wait_health(http, 200)
        followers = follower_pids(server.process.pid)
        assert len(followers) == 1
        answers = await asyncio.gather(*(complete(http, server.url, p, m) for p, m in cases))
    assert [a["choices"][0]["text"] for a in answers] == expected
    assert [a["usage"]["completion_tokens"] for a in answers] == [m for _, m in cases]
    server.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(server.process.wait, 60) == 0
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") and not zombie(pid) for pid in followers):
        assert time.monotonic() < deadline, "a follower rank outlived the server"
        await asyncio.sleep(0.1)


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_a_dying_rank_makes_the_server_exit_non_zero_instead_of_hanging(runtime):
    server = runtime("--tensor-parallel-size", "2")
    async with aiohttp.ClientSession() as http:
        await server.wait_health(http, 200)
        (follower,) = follower_pids(server.process.pid)
        os.kill(follower, signal.SIGKILL)
        code = await asyncio.to_thread(server.process.wait, 30)
    assert code not in (0, None)
    assert "Tensor-parallel rank 1 exited" in server.log()
