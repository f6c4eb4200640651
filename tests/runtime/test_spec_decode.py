"""Speculative decoding keeps greedy outputs exactly, token for token, on the random tiny model.

Each case runs the same workload with and without speculation: a KV cache small enough to force
preemption, a token budget small enough to chunk prefills, prompts that repeat themselves (so
prompt lookup finds matches), several choices (n > 1), and stop strings. The draft-model proposer
is checked with the target itself as its draft: every proposal must then be accepted, which only
holds when the draft's own KV cache and its rollbacks are exact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path

import pytest

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.async_engine import AsyncEngine
from goodput_runtime.engine.builder import build_core
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.tools.truncate_model import truncated_copy

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head dim 16, fp32


def config(model_dir: Path, blocks: int = 40, **spec) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        block_size=4,
        kv_cache_memory=blocks * 4 * BYTES_PER_TOKEN,
        max_model_len=128,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        device="cpu",
        dtype="float32",
        **spec,
    )


def workload(seed: int = 0, n: int = 8) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        phrase = [rng.randrange(5, 300) for _ in range(rng.randint(3, 8))]
        prompt = phrase * rng.randint(2, 5) + [rng.randrange(5, 300) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(
            max_tokens=rng.randint(5, 28), temperature=0.0, ignore_eos=True, n=2 if i % 4 == 0 else 1
        )
        cases.append((prompt, params))
    return cases


def run(core, cases, arrive_every: int = 3) -> dict[tuple[str, int], tuple[list[int], str, str | None]]:
    """Every case, two joining every `arrive_every` steps; (tokens, text, finish reason) per choice."""
    produced: dict[tuple[str, int], tuple[list[int], str, str | None]] = {}
    pending = list(enumerate(cases))
    steps = 0
    while pending or core.has_unfinished():
        if steps % arrive_every == 0:
            for i, (prompt, params) in pending[:2]:
                core.add(str(i), prompt, params)
            pending = pending[2:]
        for output in core.step():
            tokens, text, _ = produced.get((output.request_id, output.index), ([], "", None))
            produced[(output.request_id, output.index)] = (
                tokens + output.token_ids,
                text + output.text,
                output.finish_reason,
            )
        steps += 1
        assert steps < 5000
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks  # rollbacks leaked nothing
    return produced


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> dict[tuple[str, int], tuple[list[int], str, str | None]]:
    """The workload's outputs without speculation."""
    return run(build_core(config(tiny_model_dir)), workload())


def value(metrics: RuntimeMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model": "tiny", **labels}) or 0.0


def test_greedy_output_with_ngram_speculation_equals_without_under_preemption_chunking_and_n(tiny_model_dir, plain):
    cases = workload()
    spec_metrics = RuntimeMetrics("tiny", None, None)
    spec = run(
        build_core(
            config(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=3, speculative_max_batch=8),
            spec_metrics,
        ),
        cases,
    )
    assert spec == plain
    assert len(plain) == sum(p.n for _, p in cases)
    # the run exercised what it claims to: proposals accepted and rejected, preemption, chunked prefills
    accepted = value(spec_metrics, "goodput_spec_decode_num_accepted_tokens_total")
    proposed = value(spec_metrics, "goodput_spec_decode_num_draft_tokens_total")
    assert 0 < accepted < proposed
    assert value(spec_metrics, "goodput_preemptions_total") > 0
    assert max(len(p) for p, _ in cases) > 24
    # verification steps yield more than one token each, and the token counters agree with the outputs
    drafts = value(spec_metrics, "goodput_spec_decode_num_drafts_total")
    assert value(spec_metrics, "goodput_spec_decode_num_emitted_tokens_total") == accepted + drafts
    generated = sum(len(tokens) for tokens, _, _ in spec.values())
    assert value(spec_metrics, "goodput_generation_tokens_total") == generated


def test_stop_strings_cut_a_verified_run_where_decoding_one_token_at_a_time_stops(tiny_model_dir):
    cases = workload(seed=4, n=5)
    plain = run(build_core(config(tiny_model_dir, blocks=200)), cases)
    # a stop string from the middle of each output: it stops the request inside a verified run
    stopped_cases = []
    for i, (prompt, params) in enumerate(cases):
        text = plain[(str(i), 0)][1]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        stopped_cases.append(
            (
                prompt,
                SamplingParams(
                    max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True, stop=(stop,) if stop.strip() else ()
                ),
            )
        )
    plain_stopped = run(build_core(config(tiny_model_dir, blocks=200)), stopped_cases)
    spec_metrics = RuntimeMetrics("tiny", None, None)
    spec_stopped = run(
        build_core(
            config(
                tiny_model_dir,
                blocks=200,
                speculative_method="ngram",
                num_speculative_tokens=5,
                speculative_max_batch=8,
            ),
            spec_metrics,
        ),
        stopped_cases,
    )
    assert spec_stopped == plain_stopped
    assert sum(reason == "stop" for _, _, reason in spec_stopped.values()) >= 3
    assert value(spec_metrics, "goodput_spec_decode_num_accepted_tokens_total") > 0


def test_a_draft_model_equal_to_the_target_has_every_proposal_accepted(tiny_model_dir, plain):
    cases = workload()
    metrics = RuntimeMetrics("tiny", None, None)
    spec = run(
        build_core(
            config(
                tiny_model_dir,
                speculative_method="draft",
                speculative_model=str(tiny_model_dir),
                num_speculative_tokens=4,
                speculative_max_batch=8,
            ),
            metrics,
        ),
        cases,
    )
    assert spec == plain
    proposed = value(metrics, "goodput_spec_decode_num_draft_tokens_total")
    assert proposed > 30
    assert value(metrics, "goodput_spec_decode_num_accepted_tokens_total") == proposed
    assert value(metrics, "goodput_spec_decode_num_accepted_tokens_per_pos_total", position="3") > 0


def test_a_truncated_draft_model_keeps_greedy_output_exact(tiny_model_dir, plain, tmp_path):
    draft_dir = truncated_copy(tiny_model_dir, tmp_path / "draft", layers=1)
    cases = workload()
    metrics = RuntimeMetrics("tiny", None, None)
    spec = run(
        build_core(
            config(
                tiny_model_dir, speculative_method="draft", speculative_model=str(draft_dir), speculative_max_batch=8
            ),
            metrics,
        ),
        cases,
    )
    assert spec == plain
    assert value(metrics, "goodput_spec_decode_num_draft_tokens_total") > 0


def test_the_switch_keeps_large_batches_from_speculating(tiny_model_dir):
    core = build_core(config(tiny_model_dir, blocks=400, speculative_method="ngram", speculative_max_batch=2))
    cases = workload(seed=7, n=5)
    for i, (prompt, _) in enumerate(cases):  # finishing one after another: the batch shrinks
        core.add(str(i), prompt, SamplingParams(max_tokens=4 + 5 * i, temperature=0.0, ignore_eos=True))
    verified_at: list[int] = []
    while core.has_unfinished():
        running = len(core.scheduler.running)
        out = core.schedule()
        if any(s.draft for s in out.scheduled):
            verified_at.append(running)
        core.update(out, core.execute(out))
    assert verified_at, "never speculated once the batch had shrunk"
    assert max(verified_at) <= 2


def test_sampled_requests_speculate_and_return_every_block(tiny_model_dir):
    core = build_core(config(tiny_model_dir, speculative_method="ngram", speculative_max_batch=8))
    metrics = RuntimeMetrics("tiny", None, None)
    core.metrics = metrics
    cases = [
        (prompt, SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, ignore_eos=True, seed=i))
        for i, (prompt, _) in enumerate(workload(seed=8, n=4))
    ]
    first = run(core, cases)
    assert all(len(tokens) == 20 for tokens, _, _ in first.values())
    assert value(metrics, "goodput_spec_decode_num_drafts_total") > 0
    # seeded requests repeat themselves under speculation too
    assert run(core, cases) == first


async def test_concurrent_async_requests_with_speculation_equal_those_without(tiny_model_dir):
    cases = workload(seed=9, n=5)

    async def serve(settings: dict) -> list[list[int]]:
        cfg = config(tiny_model_dir, blocks=60, **settings)
        engine = AsyncEngine(build_core(cfg), cfg)
        await engine.start()

        async def one(i: int, prompt: list[int], params: SamplingParams) -> list[int]:
            await asyncio.sleep(0.01 * i)
            tokens: list[int] = []
            async for output in engine.add_request(f"r{i}", prompt, params):
                if output.index == 0:
                    tokens.extend(output.token_ids)
            return tokens

        try:
            return await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(cases)))
        finally:
            await engine.shutdown()

    assert await serve({"speculative_method": "ngram", "speculative_max_batch": 8}) == await serve({})


def test_a_server_with_speculation_answers_as_one_without_and_exports_its_decisions(make_server, server):
    import openai

    spec_server = make_server(speculative_method="ngram", num_speculative_tokens=4)  # threshold timed at start
    prompt = "one two three one two three one two three one two"
    answers = []
    for running in (server, spec_server):
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60)
        answers.append(
            client.completions.create(
                model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )
    assert answers[0] == answers[1]
    switch = spec_server.engine.core.scheduler.switch
    assert spec_server.metric("goodput_spec_decode_max_batch") == switch.max_batch
    steps = spec_server.metric("goodput_spec_decode_steps_total", speculated="true") + spec_server.metric(
        "goodput_spec_decode_steps_total", speculated="false"
    )
    assert steps > 0
    status, text = spec_server.get("/metrics")
    assert status == 200 and "goodput_spec_decode_num_accepted_tokens_total" in str(text)


@pytest.mark.gpu
def test_greedy_output_with_speculation_equals_without_on_a_gpu_beside_the_decode_graphs(tiny_model_dir):
    # float32 on CUDA: plain decode steps replay CUDA graphs, verification steps run eagerly beside them
    cases = workload(seed=4)

    def gpu(**spec) -> EngineConfig:
        return dataclasses.replace(config(tiny_model_dir, **spec), device="cuda")

    plain_core = build_core(gpu())
    assert plain_core.runner.graphs is not None and plain_core.runner.graphs.graphs
    expected = run(plain_core, cases)
    metrics = RuntimeMetrics("tiny", None, None)
    spec = run(
        build_core(gpu(speculative_method="ngram", num_speculative_tokens=3, speculative_max_batch=8), metrics), cases
    )
    assert spec == expected
    assert value(metrics, "goodput_spec_decode_num_accepted_tokens_total") > 0
