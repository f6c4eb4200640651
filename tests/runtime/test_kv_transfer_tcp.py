"""Disaggregated serving over the tcp transport between two runtime processes (``python -m
goodput_runtime``), on the real SmolLM2: the greedy output equals aggregated serving's token for token,
the bytes moved equal the blocks pulled times the bytes of a block, on both sides, and both runtimes
return to idle (every block free, no lease held).
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from conftest import RuntimeProcess
from kv_handoff import disaggregated, metric, post, prefill, texts, wait_idle

BLOCK = 16
BLOCK_BYTES = BLOCK * 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, float32: keys and values of 30 layers, 3 KV heads of 64
FLAGS = ("--max-model-len", "512", "--kv-cache-memory", "64Mi", "--step-tuning", "off", "--cpu-contention", "off")
KV = ("--kv-transfer-port", "0", "--kv-transfer-host", "127.0.0.1")


@pytest.fixture
def processes(smollm2_dir: Path, tmp_path: Path):
    started = [
        RuntimeProcess(smollm2_dir, tmp_path / "prefill.log", *FLAGS, *KV, "--kv-transfer-role", "prefill"),
        RuntimeProcess(smollm2_dir, tmp_path / "decode.log", *FLAGS, *KV, "--kv-transfer-role", "decode"),
    ]
    yield started
    for process in started:
        process.close()


async def test_a_hand_off_over_tcp_equals_aggregated_serving_and_moves_whole_blocks(processes):
    p, d = processes
    body = {
        "model": "tiny",
        "prompt": "A lighthouse keeper's logbook from a stormy winter records the ships that passed, the state of "
        "the lamp and the weather each night. On the coldest night of the year the keeper wrote that",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
        "max_tokens": 20,
        "temperature": 0,
        "stream": True,
    }
    async with aiohttp.ClientSession() as http:
        await p.wait_health(http, 200)
        await d.wait_health(http, 200)
        status, reference = await post(http, p.url, "/v1/completions", body)
        assert status == 200
        num_prompt = reference["usage"]["prompt_tokens"]
        params = await prefill(http, p.url, "/v1/completions", body)
        assert params["remote_host"] == "127.0.0.1" and params["remote_port"] > 0
        status, answer = await post(http, d.url, "/v1/completions", {**body, "kv_transfer_params": params})
        assert status == 200, answer
        assert texts(answer) == texts(reference)
        blocks = (num_prompt - 1) // BLOCK
        moved = await metric(http, d.url, "goodput_kv_transfer_bytes_total", role="decode")
        assert moved == blocks * BLOCK_BYTES
        assert await metric(http, p.url, "goodput_kv_transfer_bytes_total", role="prefill") == moved

        status, chat_reference = await post(http, p.url, "/v1/chat/completions", {**chat, "stream": False})
        assert status == 200
        status, events = await disaggregated(http, p.url, d.url, "/v1/chat/completions", chat)
        assert status == 200, events
        assert texts(events) == texts(chat_reference)
        assert await metric(http, d.url, "goodput_kv_transfers_total", role="decode", outcome="success") == 2
        assert await metric(http, d.url, "goodput_kv_transfer_seconds_count", role="decode") == 2
        assert await metric(http, d.url, "goodput_kv_transfer_seconds_count", role="peer") == 0  # no peer pull
        await wait_idle(http, p.url)
        await wait_idle(http, d.url)
        assert await metric(http, p.url, "goodput_kv_lease_blocks") == 0
