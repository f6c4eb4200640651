"""Disaggregated serving through the in-process transport, on the real SmolLM2: a prefill runtime
computes the prompt and leases its blocks, a decode runtime pulls the blocks it lacks and decodes. The
greedy output equals aggregated serving's (the same request on one runtime) token for token: prompts
that end inside a block, a decode side already holding part of the prefix, n > 1, streaming, structured
output, and preemption on the decode side. Both runtimes are real servers (server_thread.ServerThread)
answering real HTTP; afterwards every block is free again on both.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from kv_handoff import disaggregated, metric, post, prefill, texts, wait_idle
from server_thread import ServerThread

BLOCK = 16
TOKEN_BYTES = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: keys and values, 30 layers, 3 KV heads of 64, float32
BLOCK_BYTES = BLOCK * TOKEN_BYTES
DECODE_BLOCKS = 14  # a small cache, so that concurrent decodes preempt each other

PROMPTS = [
    "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and France "
    "experimented with two-wheeled machines pushed along by the rider's feet. Over the following decades",
    "Write a short note to a neighbour explaining that the shared garden gate is broken and will be repaired on "
    "Saturday morning, and ask them to keep their dog inside until then. The note should",
    "Photosynthesis converts light energy into chemical energy stored in sugars. In plants it takes place mostly in",
]
COMMON = {"step_tuning": "off", "cpu_contention": "off", "kv_transfer_transport": "local", "block_size": BLOCK}


@pytest.fixture(scope="module")
def pair(smollm2_dir: Path):
    """(prefill runtime, decode runtime): the prefill one also serves the aggregated reference."""
    p = ServerThread(smollm2_dir, kv_transfer_role="prefill", max_model_len=512, kv_cache_memory=64 << 20, **COMMON)
    d = ServerThread(
        smollm2_dir,
        kv_transfer_role="decode",
        max_model_len=DECODE_BLOCKS * BLOCK,
        kv_cache_memory=DECODE_BLOCKS * BLOCK_BYTES,
        **COMMON,
    )
    p.start()
    d.start()
    yield p, d
    p.stop()
    d.stop()


def completion(prompt: str, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **extra}


async def test_greedy_completions_through_a_hand_off_equal_aggregated_serving(pair):
    p, d = pair
    agent = d.engine.kv_transfer
    async with aiohttp.ClientSession() as http:
        for prompt in PROMPTS:
            body = completion(prompt)
            status, reference = await post(http, p.url, "/v1/completions", body)
            assert status == 200
            num_prompt = reference["usage"]["prompt_tokens"]
            assert num_prompt % BLOCK, "the prompt should end inside a block"
            pulled, moved = agent.stats.blocks_pulled, agent.stats.bytes_pulled
            params = await prefill(http, p.url, "/v1/completions", body)
            assert params["num_tokens"] == num_prompt // BLOCK * BLOCK
            assert len(params["remote_block_ids"]) == len(params["block_digests"]) == num_prompt // BLOCK
            status, answer = await post(http, d.url, "/v1/completions", {**body, "kv_transfer_params": params})
            assert status == 200, answer
            assert texts(answer) == texts(reference)
            assert answer["usage"]["completion_tokens"] == 24
            # every full block but the one the prompt's last token would need is pulled: nothing was cached here
            blocks = (num_prompt - 1) // BLOCK
            assert agent.stats.blocks_pulled - pulled == blocks
            assert agent.stats.bytes_pulled - moved == blocks * BLOCK_BYTES
        assert await metric(http, d.url, "goodput_kv_transfers_total", role="decode", outcome="success") >= 3
        await wait_idle(http, p.url)
        await wait_idle(http, d.url)


async def test_a_decode_side_holding_part_of_the_prefix_pulls_only_the_rest(pair):
    p, d = pair
    agent = d.engine.kv_transfer
    shared = PROMPTS[1]
    async with aiohttp.ClientSession() as http:
        status, _ = await post(http, d.url, "/v1/completions", completion(shared, max_tokens=2))
        assert status == 200
        body = completion(shared + " be polite and brief, and sign it with your first name only.")
        status, reference = await post(http, p.url, "/v1/completions", body)
        reused, pulled = agent.stats.blocks_reused, agent.stats.blocks_pulled
        status, answer = await disaggregated(http, p.url, d.url, "/v1/completions", body)
        assert status == 200, answer
        assert texts(answer) == texts(reference)
        held = agent.stats.blocks_reused - reused
        assert held >= 2, "the shared prefix's blocks should have been found here"
        num_prompt = reference["usage"]["prompt_tokens"]
        assert held + agent.stats.blocks_pulled - pulled == (num_prompt - 1) // BLOCK
        await wait_idle(http, p.url)
        await wait_idle(http, d.url)


async def test_n_choices_and_streaming_through_a_hand_off_equal_aggregated_serving(pair):
    p, d = pair
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Name three rivers in Europe and say which sea each flows into."}],
        "max_tokens": 20,
        "temperature": 0,
        "n": 2,
    }
    async with aiohttp.ClientSession() as http:
        status, reference = await post(http, p.url, "/v1/chat/completions", body)
        assert status == 200
        status, whole = await disaggregated(http, p.url, d.url, "/v1/chat/completions", body)
        assert status == 200, whole
        assert texts(whole) == texts(reference) and len(texts(whole)) == 2
        status, events = await disaggregated(http, p.url, d.url, "/v1/chat/completions", {**body, "stream": True})
        assert status == 200, events
        assert events[-1] == "[DONE]"
        assert texts(events) == texts(reference)
        await wait_idle(http, p.url)
        await wait_idle(http, d.url)


async def test_structured_output_through_a_hand_off_equals_aggregated_serving(pair):
    p, d = pair
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
    }
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Give the largest city of Japan and its population as JSON."}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    }
    async with aiohttp.ClientSession() as http:
        status, reference = await post(http, p.url, "/v1/chat/completions", body)
        assert status == 200
        status, answer = await disaggregated(http, p.url, d.url, "/v1/chat/completions", body)
        assert status == 200, answer
        assert texts(answer) == texts(reference)
        assert texts(answer)[0].startswith("{")


async def test_preemption_on_the_decode_side_keeps_the_greedy_output(pair):
    p, d = pair
    bodies = [completion(prompt, max_tokens=48) for prompt in [*PROMPTS, PROMPTS[0] + " Today"]]
    async with aiohttp.ClientSession() as http:
        references = [texts((await post(http, p.url, "/v1/completions", b))[1]) for b in bodies]
        handoffs = [await prefill(http, p.url, "/v1/completions", b) for b in bodies]
        before = await metric(http, d.url, "goodput_preemptions_total")
        pulls, failures = d.engine.kv_transfer.stats.pulls, d.engine.kv_transfer.stats.failures
        answers = await asyncio.gather(
            *(
                post(http, d.url, "/v1/completions", {**b, "kv_transfer_params": h})
                for b, h in zip(bodies, handoffs, strict=True)
            )
        )
        assert all(status == 200 for status, _ in answers), answers
        assert [texts(a) for _, a in answers] == references
        # four requests of ~100 tokens each do not fit 14 blocks of 16 at once
        assert await metric(http, d.url, "goodput_preemptions_total") > before
        assert d.engine.kv_transfer.stats.pulls - pulls == 4 and d.engine.kv_transfer.stats.failures == failures
        await wait_idle(http, p.url)
        await wait_idle(http, d.url)
