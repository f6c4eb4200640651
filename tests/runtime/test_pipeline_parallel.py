"""Pipeline and tensor parallelism across processes on CPU (gloo), the way pods run them.

A deeper random Llama (5 layers, so two stages split it 3 + 2) gives one process's greedy tokens
under TP 2, PP 2 and TP 2 × PP 2; two runtime processes started as a replica's two pods (each
told its node rank, the node count and the leader's address) serve the same answers; and a
worker pod killed mid-step takes the whole group down with a non-zero exit, never a hang.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.sampling import SamplingParams
from tests.conftest import MODEL_CACHE
from tests.runtime.test_tensor_parallel import run_staggered, workload

LAYERS = 5


@pytest.fixture(scope="session")
def deep_model_dir(tiny_model_dir: Path) -> Path:
    """The tiny model's tokenizer and shape with 5 decoder layers of fresh random weights (cached beside
    the other test models: a directory under the shared pytest temp root may be cleaned mid-run)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = MODEL_CACHE / f"deep-llama-{LAYERS}-{tiny_model_dir.name}"
    if (out / "model.safetensors").exists():
        return out
    partial = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for item in tiny_model_dir.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            shutil.copy(item, partial / item.name)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_hidden_layers = LAYERS
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(partial)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def config(model_dir: Path, tensor: int, pipeline: int) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        block_size=4,
        kv_cache_memory=1 << 20,
        max_model_len=128,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        tensor_parallel_size=tensor,
        pipeline_parallel_size=pipeline,
        num_threads=1,
    )


@pytest.fixture(scope="module")
def single_process_tokens(deep_model_dir: Path) -> list[list[int]]:
    return run_staggered(build_core(config(deep_model_dir, 1, 1)), workload())


@pytest.mark.parametrize(("tensor", "pipeline"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_split_models_give_the_single_process_greedy_tokens(deep_model_dir, single_process_tokens, tensor, pipeline):
    core = build_core(config(deep_model_dir, tensor, pipeline))
    try:
        assert core.runner.layout.num_layers == (3 if pipeline == 2 else LAYERS)  # rank 0 caches its stage alone
        assert core.runner.layout.kv_heads == 2 // tensor
        produced = run_staggered(core, workload())
    finally:
        core.close()
    assert produced == single_process_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pod:
    """A runtime process started as one pod of a replica: its node rank, the node count, the leader."""

    def __init__(self, model_dir: Path, log_path: Path, node_rank: int, leader: str, port: int, *flags: str):
        self.log_path = log_path
        env = {**os.environ, "GOODPUT_NODE_RANK": str(node_rank), "GOODPUT_NNODES": "2"}
        env["GOODPUT_LEADER_ADDRESS"] = leader  # as the operator sets them
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "goodput_runtime",
                "--model",
                str(model_dir),
                "--served-model-name",
                "deep",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--max-model-len",
                "512",
                "--kv-cache-memory",
                "2Mi",
                "--num-threads",
                "1",
                *flags,
            ],
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait_health(self, http: aiohttp.ClientSession, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, self.log()
            try:
                async with http.get(f"{self.url}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, self.log()
            await asyncio.sleep(0.2)


@pytest.fixture
def pods(deep_model_dir: Path, tmp_path: Path):
    """A replica of two pods (TP 2 × PP 2: two ranks each); both killed at the end if still running."""
    leader = f"127.0.0.1:{free_port()}"
    flags = ("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")
    started = [Pod(deep_model_dir, tmp_path / f"pod-{rank}.log", rank, leader, free_port(), *flags) for rank in (0, 1)]
    yield started
    for pod in started:
        if pod.process.poll() is None:
            pod.process.kill()
            pod.process.wait(10)


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": "deep", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    async with http.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["choices"][0]["text"]


async def test_two_pods_serve_the_single_process_answers_and_die_together(deep_model_dir, pods):
    """The leader serves one process's answers, the worker pod /health alone; then the worker pod is
    killed mid-step and the whole group exits non-zero within the heartbeat's bound."""
    cases = workload(6)
    single = build_core(config(deep_model_dir, 1, 1))
    texts = {str(i): "" for i in range(len(cases))}
    for i, (prompt, max_tokens) in enumerate(cases):
        single.add(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while single.has_unfinished():
        for out in single.step():
            texts[out.request_id] += out.text
    leader, worker = pods
    async with aiohttp.ClientSession() as http:
        await worker.wait_health(http)
        await leader.wait_health(http)
        answers = await asyncio.gather(*(complete(http, leader.url, p, m) for p, m in cases))
        assert answers == [texts[str(i)] for i in range(len(cases))]
        async with http.post(f"{worker.url}/v1/completions", json={}) as response:
            assert response.status == 404  # a worker pod serves /health alone
        assert "Pod 1 of 2 joined the group" in leader.log()

        ranks = descendants(worker.process.pid)
        assert len(ranks) == 1  # the worker pod's second rank
        requests = [asyncio.create_task(complete(http, leader.url, [5 + i, 7, 9], 400)) for i in range(4)]
        await asyncio.sleep(1.0)  # decoding
        assert not any(r.done() for r in requests)
        worker.process.kill()
        started = time.monotonic()
        code = await asyncio.to_thread(leader.process.wait, 30)
        took = time.monotonic() - started
        await asyncio.gather(*requests, return_exceptions=True)
    assert code not in (0, None)
    assert took < 15, f"the leader took {took:.1f}s to notice"
    assert "pod 1 closed its connection" in leader.log()
    deadline = time.monotonic() + 15
    while any(Path(f"/proc/{pid}").exists() and not zombie(pid) for pid in ranks):
        assert time.monotonic() < deadline, "the killed pod's other rank outlived it"
        await asyncio.sleep(0.1)


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_real_model_split_gives_one_process_greedy_tokens(smollm2_dir):
    """SmolLM2-135M (30 layers, 9 heads, 3 KV heads: tensor parallelism splits it 3 ways, not 2) as
    TP 3 × PP 2, six ranks: 15 + 15 layers, 3 ranks per stage, give one process's greedy chat answers."""
    tensor, pipeline = 3, 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        ).input_ids
        for q in ("What is the capital of France?", "Give me three tips for writing clear code.")
    ]

    def answers(tensor: int, pipeline: int) -> list[list[int]]:
        cfg = EngineConfig(
            model=str(smollm2_dir),
            device="cpu",
            dtype="float32",
            kv_cache_memory=64 << 20,
            max_model_len=512,
            tensor_parallel_size=tensor,
            pipeline_parallel_size=pipeline,
            num_threads=1,
        )
        core = build_core(cfg)
        try:
            out = {str(i): [] for i in range(len(prompts))}
            for i, prompt in enumerate(prompts):
                core.add(str(i), prompt, SamplingParams(max_tokens=16, temperature=0.0))
            while core.has_unfinished():
                for o in core.step():
                    out[o.request_id].extend(o.token_ids)
            return [out[str(i)] for i in range(len(prompts))]
        finally:
            core.close()

    expected = answers(1, 1)
    assert all(len(a) > 3 for a in expected)
    assert answers(tensor, pipeline) == expected
