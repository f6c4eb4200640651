"""Pipeline and tensor parallelism across processes on CPU (gloo), the way pods run them.

A deeper random Llama (5 layers, so two stages split it 3 + 2) gives one process's greedy tokens
under TP 2, PP 2 and TP 2 × PP 2, with the step split into micro-batches (one per stage by default,
one, or more than a step has sequences); two runtime processes started as a replica's two pods (each
told its node rank, the node count and the leader's address) serve the same answers; and a
worker pod killed mid-step takes the whole group down with a non-zero exit, never a hang. The
per-stage trace of each micro-batch's forward shows the stages working at once.
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
from goodput_runtime.engine.config_error import EngineConfigError
from goodput_runtime.engine.pipeline_schedule import TRACE_ENV, bubble, decode_only, read_trace
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


def config(model_dir: Path, tensor: int, pipeline: int, microbatches: int | None = None) -> EngineConfig:
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
        pipeline_microbatches=microbatches,
        num_threads=1,
    )


@pytest.fixture(scope="module")
def single_process_tokens(deep_model_dir: Path) -> list[list[int]]:
    return run_staggered(build_core(config(deep_model_dir, 1, 1)), workload())


@pytest.mark.parametrize(
    ("tensor", "pipeline", "microbatches"),
    [(2, 1, None), (1, 2, None), (1, 2, 1), (1, 2, 4), (2, 2, None)],
    ids=["tp2", "pp2", "pp2-one-microbatch", "pp2-4-microbatches", "tp2xpp2"],
)
def test_split_models_give_the_single_process_greedy_tokens(
    deep_model_dir, single_process_tokens, tensor, pipeline, microbatches
):
    """PP 2 by default splits each step in two micro-batches; 4 is more than most of this workload's
    steps have sequences (two new requests every other step, prompt chunks of 24 tokens at most)."""
    core = build_core(config(deep_model_dir, tensor, pipeline, microbatches))
    try:
        assert core.runner.layout.num_layers == (3 if pipeline == 2 else LAYERS)  # rank 0 caches its stage alone
        assert core.runner.layout.kv_heads == 2 // tensor
        if pipeline > 1:
            assert core.runner.pipeline.microbatches == (microbatches or pipeline)
        produced = run_staggered(core, workload())
    finally:
        core.close()
    assert produced == single_process_tokens


@pytest.mark.parametrize(
    ("pipeline", "microbatches", "says"),
    [(2, 0, "--pipeline-microbatches 0"), (1, 2, "--pipeline-microbatches 2 needs --pipeline-parallel-size")],
)
def test_the_engine_refuses_micro_batches_it_cannot_run(deep_model_dir, pipeline, microbatches, says):
    """Before any rank starts: a count below one, or micro-batches without stages to pass them between."""
    with pytest.raises(EngineConfigError, match=says):
        build_core(config(deep_model_dir, 1, pipeline, microbatches))


def traced_run(model_dir: Path, trace: Path, monkeypatch, microbatches: int | None, cases) -> list[list[int]]:
    """The workload's greedy tokens under PP 2, every rank tracing its steps to `trace`."""
    monkeypatch.setenv(TRACE_ENV, str(trace))  # the follower ranks inherit it
    core = build_core(config(model_dir, 1, 2, microbatches))
    try:
        return run_staggered(core, cases)
    finally:
        core.close()
        monkeypatch.delenv(TRACE_ENV)


def test_prompt_logprobs_and_embeddings_survive_cut_prompts(deep_model_dir):
    """Three micro-batches over steps mixing embedding prompts (never cut: their rows are pooled whole),
    a prompt asking for its logprobs (cut, its rows shared between the parts) and decodes: the same
    tokens, logprobs and vectors as one process."""
    from goodput_runtime.engine.sequence import PoolingParams

    def outputs(pipeline: int, microbatches: int | None) -> dict[str, list]:
        core = build_core(config(deep_model_dir, 1, pipeline, microbatches))
        out: dict[str, list] = {}
        try:
            core.add("mean", list(range(5, 35)), SamplingParams(max_tokens=1), PoolingParams("mean", normalize=False))
            generate = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2, logprobs=1)
            core.add("logprobs", list(range(40, 60)), generate)
            core.add("last", list(range(7, 30)), SamplingParams(max_tokens=1), PoolingParams("last", normalize=False))
            core.add("short", [70, 71, 72], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            while core.has_unfinished():
                for o in core.step():
                    out.setdefault(o.request_id, []).append(o)
        finally:
            core.close()
        return out

    one, split_up = outputs(1, None), outputs(2, 3)
    for name in ("mean", "last"):
        assert one[name][-1].embedding == pytest.approx(split_up[name][-1].embedding, abs=1e-4)
    for name in ("logprobs", "short"):
        assert [t for o in one[name] for t in o.token_ids] == [t for o in split_up[name] for t in o.token_ids]
    prompt = [next(o.prompt_logprobs for o in out["logprobs"] if o.prompt_logprobs) for out in (one, split_up)]
    assert len(prompt[0]) == len(prompt[1]) == 20
    for a, b in zip(prompt[0][1:], prompt[1][1:], strict=True):
        assert (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_a_batch_smaller_than_the_micro_batch_count(deep_model_dir, tmp_path, monkeypatch):
    """One sequence, 4 micro-batches asked for: its decode steps run as one micro-batch, its prompt is
    cut into parts of the prompt, and the tokens are one process's."""
    cases = [([(j * 7) % 900 + 5 for j in range(20)], 12)]
    expected = run_staggered(build_core(config(deep_model_dir, 1, 1)), cases)
    assert traced_run(deep_model_dir, tmp_path, monkeypatch, 4, cases) == expected
    steps = read_trace(tmp_path)
    prompt, *decodes = (steps[k] for k in sorted(steps))
    assert {r["microbatches"] for r in prompt} == {4}  # 20 prompt tokens in four parts of five
    assert sorted(r["tokens"] for r in prompt if r["rank"] == 0 and r["what"] == "forward") == [5, 5, 5, 5]
    assert len(decodes) == 11 and all(r["microbatches"] == 1 for step in decodes for r in step)


def test_stages_work_on_different_micro_batches_at_once(deep_model_dir, tmp_path, monkeypatch):
    """The trace of each stage's forward per micro-batch, on the machine's monotonic clock: in steady
    decode stage 0 starts micro-batch 1 before stage 1 is done with micro-batch 0 (it does not wait for
    the step to come back), and the two run at the same time; with one micro-batch they never do.

    The ranks are processes the OS schedules: on a machine whose cores are busy with other work one may
    be descheduled just as the other runs (this one measured 60-90% of steps going on, 55-80% at the
    same time, at a load of 25-40 on two cores), so the bounds below are well under what it shows."""
    cases = [([(i * 53 + j * 11) % 900 + 5 for j in range(6)], 32) for i in range(8)]
    expected = run_staggered(build_core(config(deep_model_dir, 1, 1)), cases)
    assert traced_run(deep_model_dir, tmp_path / "two", monkeypatch, 2, cases) == expected
    assert traced_run(deep_model_dir, tmp_path / "one", monkeypatch, 1, cases) == expected

    def forwards(step: list[dict]) -> dict[tuple[int, int], dict]:
        return {(r["stage"], r["mb"]): r for r in step if r["what"] == "forward"}

    steady = [s for s in read_trace(tmp_path / "two").values() if decode_only(s) and s[0]["microbatches"] == 2]
    assert len(steady) >= 25
    went_on = together = 0
    for step in steady:
        f = forwards(step)
        assert f[0, 1]["start"] >= f[0, 0]["end"] and f[1, 0]["start"] >= f[0, 0]["end"]  # causality, one clock
        went_on += f[0, 1]["start"] < f[1, 0]["end"]
        together += max(f[0, 1]["start"], f[1, 0]["start"]) < min(f[0, 1]["end"], f[1, 0]["end"])
    assert went_on >= 0.4 * len(steady), (went_on, len(steady))
    assert together >= 0.25 * len(steady), (together, len(steady))

    one = [s for s in read_trace(tmp_path / "one").values() if decode_only(s)]
    for step in one:
        f = forwards(step)
        assert set(f) == {(0, 0), (1, 0)} and f[1, 0]["start"] >= f[0, 0]["end"]  # the stages in turn
    two_bubble, one_bubble = bubble(steady)["bubble"], bubble(one)["bubble"]
    print(f"bubble: {one_bubble:.0%} with one micro-batch, {two_bubble:.0%} with two")


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
    # closed, or reset where the leader's last heartbeat was still unread in the killed pod
    assert "pod 1 closed its connection" in leader.log() or "pod 1 is gone" in leader.log()
    deadline = time.monotonic() + 15
    while any(Path(f"/proc/{pid}").exists() and not zombie(pid) for pid in ranks):
        assert time.monotonic() < deadline, "the killed pod's other rank outlived it"
        await asyncio.sleep(0.1)


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# about 70 s on 2 cores: `make test-extended` only; the splits of the small models above prove the same
# equality on every run, and this one the real model's shapes (9 heads, 3 KV heads)
@pytest.mark.extended
def test_the_real_model_split_gives_one_process_greedy_tokens(smollm2_dir):
    """SmolLM2-135M (30 layers, 9 heads, 3 KV heads: tensor parallelism splits it 3 ways, not 2) as
    TP 3 × PP 2, six ranks: 15 + 15 layers, 3 ranks per stage, two micro-batches (the default), and as
    PP 2 with three micro-batches (the two prompts cut in three, the two decodes in two), give one
    process's greedy chat answers."""
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

    def answers(tensor: int, pipeline: int, microbatches: int | None = None) -> list[list[int]]:
        cfg = EngineConfig(
            model=str(smollm2_dir),
            device="cpu",
            dtype="float32",
            kv_cache_memory=64 << 20,
            max_model_len=512,
            tensor_parallel_size=tensor,
            pipeline_parallel_size=pipeline,
            pipeline_microbatches=microbatches,
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
    assert answers(1, pipeline, 3) == expected
