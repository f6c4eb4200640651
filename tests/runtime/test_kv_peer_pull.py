"""Peer pulls between real runtime processes on the random-weight tiny model (tcp, role both):

- a receiver asked to pull a prompt's leading blocks from a replica that holds them answers the same
  greedy tokens as recomputing, reports the pulled tokens as cached (its prefill shrinks by them),
  and counts the pull, its blocks and bytes;
- a holder that no longer holds a block (never computed it) refuses with ``not_held``; the receiver
  recomputes and the request succeeds;
- a holder that dies mid-pull (stopped with the connection open, then killed): the receiver
  recomputes and the request succeeds, the fallback counted;
- a malformed peer pull is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
from kv_handoff import metric, post, texts, wait_idle

SAME = ("--step-tuning", "off", "--cpu-contention", "off", "--kv-transfer-host", "127.0.0.1")
BOTH = (*SAME, "--kv-transfer-role", "both", "--kv-transfer-port", "0", "--kv-transfer-timeout", "20")
PROMPT = "a prefix held on one replica is pulled by another instead of being computed again " * 5


def body(prompt: str, max_tokens: int = 16) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def transfer_port(process) -> int:
    return int(process.wait_for_log(r"serving blocks on port (\d+)"))


async def digests(http: aiohttp.ClientSession, url: str, request: dict) -> dict:
    async with http.post(f"{url}/kv/digests?api=completions", json=request) as response:
        assert response.status == 200
        return await response.json()


def peer(port: int, held: dict, blocks: int | None = None) -> dict:
    chosen = held["digests"][: blocks or len(held["digests"])]
    return {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "block_digests": chosen,
        "num_tokens": len(chosen) * held["block_size"],
    }


def cached(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def test_a_pulled_prefix_equals_recomputing_and_shrinks_the_prefill(runtime):
    holder, receiver, fresh = runtime(*BOTH), runtime(*BOTH), runtime(*BOTH)
    port = transfer_port(holder)
    async with aiohttp.ClientSession() as http:
        for process in (holder, receiver, fresh):
            await process.wait_health(http, 200)
        status, reference = await post(http, fresh.url, "/v1/completions", body(PROMPT))  # recomputed
        assert status == 200 and cached(reference) == 0
        status, answer = await post(http, holder.url, "/v1/completions", body(PROMPT))  # the holder computes it
        assert status == 200 and texts(answer) == texts(reference)
        held = await digests(http, receiver.url, body(PROMPT))
        blocks = len(held["digests"])
        assert blocks >= 4

        status, answer = await post(
            http, receiver.url, "/v1/completions", {**body(PROMPT), "kv_transfer_params": peer(port, held)}
        )
        assert status == 200, answer
        assert texts(answer) == texts(reference)
        pulled = cached(answer)
        assert pulled == blocks * held["block_size"] or pulled == (blocks - 1) * held["block_size"]
        assert answer["usage"]["prompt_tokens"] - pulled < held["block_size"] + 1  # only the tail computed here
        assert await metric(http, receiver.url, "goodput_kv_transfers_total", role="peer", outcome="success") == 1
        # timed as a peer pull, apart from disaggregated hand-offs (role decode)
        assert await metric(http, receiver.url, "goodput_kv_transfer_seconds_count", role="peer") == 1
        assert await metric(http, receiver.url, "goodput_kv_transfer_seconds_count", role="decode") == 0
        blocks_in = await metric(http, receiver.url, "goodput_kv_transfer_blocks_total", role="peer")
        bytes_in = await metric(http, receiver.url, "goodput_kv_transfer_bytes_total", role="peer")
        assert blocks_in == pulled // held["block_size"] and bytes_in > 0
        assert await metric(http, holder.url, "goodput_kv_transfer_bytes_total", role="holder") == bytes_in
        assert await metric(http, holder.url, "goodput_kv_transfer_blocks_total", role="holder") == blocks_in

        # a second pull of the same prompt finds it held here already: nothing moves
        status, again = await post(
            http, receiver.url, "/v1/completions", {**body(PROMPT), "kv_transfer_params": peer(port, held)}
        )
        assert status == 200 and texts(again) == texts(reference)
        assert await metric(http, receiver.url, "goodput_kv_transfer_blocks_total", role="peer") == blocks_in

        # a prompt the holder never computed: not_held, recomputed, the same tokens as a fresh replica
        other = "another system prompt that nobody has computed yet, so no replica holds it " * 5
        status, reference = await post(http, fresh.url, "/v1/completions", body(other))
        held = await digests(http, receiver.url, body(other))
        status, answer = await post(
            http, receiver.url, "/v1/completions", {**body(other), "kv_transfer_params": peer(port, held)}
        )
        assert status == 200 and texts(answer) == texts(reference) and cached(answer) == 0
        assert await metric(http, receiver.url, "goodput_kv_transfer_failures_total", reason="not_held") == 1
        assert await metric(http, receiver.url, "goodput_kv_transfers_total", role="peer", outcome="failure") == 1

        # malformed: a 400 naming the field
        bad = {**peer(port, held), "lease_seconds": 3}
        status, answer = await post(http, receiver.url, "/v1/completions", {**body(other), "kv_transfer_params": bad})
        assert status == 400 and "lease_seconds" in answer["error"]["message"]
        await wait_idle(http, receiver.url)


async def test_a_holder_that_dies_mid_pull_falls_back_to_recomputing(runtime):
    holder, receiver, fresh = runtime(*BOTH), runtime(*BOTH), runtime(*BOTH)
    port = transfer_port(holder)
    async with aiohttp.ClientSession() as http:
        for process in (holder, receiver, fresh):
            await process.wait_health(http, 200)
        status, reference = await post(http, fresh.url, "/v1/completions", body(PROMPT))
        assert status == 200
        status, _ = await post(http, holder.url, "/v1/completions", body(PROMPT))
        assert status == 200
        held = await digests(http, receiver.url, body(PROMPT))

        os.kill(holder.process.pid, signal.SIGSTOP)  # accepts the connection (the kernel's), answers nothing
        request = {**body(PROMPT), "kv_transfer_params": peer(port, held)}
        pending = asyncio.ensure_future(post(http, receiver.url, "/v1/completions", request))
        await asyncio.sleep(1.0)  # the receiver has connected and waits for the blocks
        assert not pending.done()
        holder.process.kill()
        holder.process.wait(timeout=30)
        status, answer = await asyncio.wait_for(pending, 60)
        assert status == 200, answer
        assert texts(answer) == texts(reference) and cached(answer) == 0
        assert await metric(http, receiver.url, "goodput_kv_transfers_total", role="peer", outcome="failure") == 1
        assert await metric(http, receiver.url, "goodput_kv_transfer_failures_total", reason="unreachable") == 1
        await wait_idle(http, receiver.url)
