"""Faults of the KV hand-off, between real runtime processes on the random-weight tiny model (tcp):

- a prefill runtime killed after answering: recompute serves the same tokens; fail answers 503
  kv_transfer_failed naming the cause, within --kv-transfer-timeout (a silent peer included);
- a decode side that never pulls: the prefill side's blocks come back when the lease runs out, and a late
  pull finds no lease and recomputes;
- a layout mismatch (another block size): refused, then served locally, whatever the policy;
- a thousand random aborts across both roles: no block leaks on either side (/debug/state);
- kv_transfer_params where the role does not allow it, or malformed: a 400 naming the field.

Greedy tokens of a random-weight model are compared with a reference computed the same way (a plain
request on a runtime started with the same flags), never with fixed text.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time

import aiohttp
from kv_handoff import debug_state, metric, post, prefill, texts, wait_idle

SAME = ("--step-tuning", "off", "--cpu-contention", "off", "--kv-transfer-host", "127.0.0.1", "--kv-transfer-port", "0")
PREFILL = (*SAME, "--kv-transfer-role", "prefill")
DECODE = (*SAME, "--kv-transfer-role", "decode")
TIMEOUT = 3.0


def body(prompt: str, max_tokens: int = 16) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


async def started(http: aiohttp.ClientSession, *processes) -> None:
    for process in processes:
        await process.wait_health(http, 200)


async def test_a_prefill_runtime_killed_after_answering(runtime):
    p = runtime(*PREFILL)
    recompute = runtime(*DECODE)
    fail = runtime(*DECODE, "--kv-failure-policy", "fail", "--kv-transfer-timeout", str(TIMEOUT))
    prompt = "the quick brown fox jumps over the lazy dog " * 6
    async with aiohttp.ClientSession() as http:
        await started(http, p, recompute, fail)
        status, reference = await post(http, p.url, "/v1/completions", body(prompt))
        assert status == 200
        first = await prefill(http, p.url, "/v1/completions", body(prompt))
        second = await prefill(http, p.url, "/v1/completions", body(prompt))
        p.process.kill()
        p.process.wait(timeout=30)

        status, answer = await post(
            http, recompute.url, "/v1/completions", {**body(prompt), "kv_transfer_params": first}
        )
        assert status == 200, answer
        assert texts(answer) == texts(reference)
        assert await metric(http, recompute.url, "goodput_kv_transfer_failures_total", reason="unreachable") == 1

        begun = time.monotonic()
        status, answer = await post(http, fail.url, "/v1/completions", {**body(prompt), "kv_transfer_params": second})
        assert status == 503, answer
        assert answer["error"]["type"] == "kv_transfer_failed" and "unreachable" in answer["error"]["message"]
        assert time.monotonic() - begun < TIMEOUT + 10

        # a peer that accepts the connection and never answers: the wait ends at --kv-transfer-timeout
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        try:
            begun = time.monotonic()
            hung = {**second, "remote_port": silent.getsockname()[1]}
            status, answer = await post(http, fail.url, "/v1/completions", {**body(prompt), "kv_transfer_params": hung})
            elapsed = time.monotonic() - begun
        finally:
            silent.close()
        assert status == 503 and "timeout" in answer["error"]["message"], answer
        assert TIMEOUT * 0.9 <= elapsed < TIMEOUT + 10
        assert await metric(http, fail.url, "goodput_kv_transfer_failures_total", reason="timeout") == 1
        await wait_idle(http, recompute.url)
        await wait_idle(http, fail.url)


async def test_a_decode_side_that_never_pulls_and_a_layout_mismatch(runtime):
    p = runtime(*PREFILL, "--kv-lease-seconds", "1")
    d = runtime(*DECODE, "--kv-failure-policy", "fail")
    other = runtime(*DECODE, "--kv-failure-policy", "fail", "--block-size", "8")  # another layout
    prompt = "a stable digest names every block of a prefix on every replica " * 4
    async with aiohttp.ClientSession() as http:
        await started(http, p, d, other)
        status, reference = await post(http, p.url, "/v1/completions", body(prompt))
        assert status == 200
        await wait_idle(http, p.url)
        params = await prefill(http, p.url, "/v1/completions", body(prompt))
        held = (await debug_state(http, p.url))["kv_transfer"]
        assert held["leases"] == 1 and held["lease_blocks"] == len(params["remote_block_ids"]) > 0
        state = await wait_idle(http, p.url, timeout=30)  # nobody pulls: the lease runs out
        assert state["kv_transfer"]["lease_expiries"] == 1
        assert await metric(http, p.url, "goodput_kv_lease_expiries_total") == 1

        # a late pull finds no lease: a failure (fail policy: 503 naming it)
        status, answer = await post(http, d.url, "/v1/completions", {**body(prompt), "kv_transfer_params": params})
        assert status == 503 and "lease_gone" in answer["error"]["message"], answer

        # another block size: refused before any pull, and served here even under the fail policy
        params = await prefill(http, p.url, "/v1/completions", body(prompt))
        status, answer = await post(http, other.url, "/v1/completions", {**body(prompt), "kv_transfer_params": params})
        assert status == 200, answer
        assert texts(answer) == texts(reference)
        assert await metric(http, other.url, "goodput_kv_transfer_failures_total", reason="layout_mismatch") == 1
        await wait_idle(http, p.url, timeout=30)
        await wait_idle(http, d.url)
        await wait_idle(http, other.url)


async def test_random_aborts_across_both_roles_leak_no_block(runtime):
    p = runtime(*PREFILL, "--kv-lease-seconds", "2")
    d = runtime(*DECODE)
    rng = random.Random(33)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda"]
    counts = {"prefill_aborted": 0, "decode_aborted": 0, "never_pulled": 0, "completed": 0}
    async with aiohttp.ClientSession() as http:
        await started(http, p, d)

        async def one(i: int) -> None:
            request = body(" ".join(rng.choice(words) for _ in range(rng.randrange(5, 80))), rng.randrange(1, 24))
            kind = rng.choice(list(counts))
            counts[kind] += 1
            if kind == "prefill_aborted":
                phase = {**request, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
                await abort_after(post(http, p.url, "/v1/completions", phase), rng.uniform(0, 0.05))
                return
            params = await prefill(http, p.url, "/v1/completions", request)
            if kind == "never_pulled":
                return
            decode = post(http, d.url, "/v1/completions", {**request, "kv_transfer_params": params})
            if kind == "decode_aborted":
                await abort_after(decode, rng.uniform(0, 0.1))
            else:
                status, answer = await decode
                assert status == 200, answer

        queue = list(range(1000))

        async def worker() -> None:
            while queue:
                await one(queue.pop())

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(16))), 900)
        assert min(counts.values()) > 100, counts
        await wait_idle(http, p.url, timeout=60)
        await wait_idle(http, d.url, timeout=60)


async def abort_after(request, seconds: float) -> None:
    """The client gives up after `seconds`: the connection closes and the server aborts the request."""
    try:
        await asyncio.wait_for(request, seconds)
    except asyncio.TimeoutError:
        pass


async def test_kv_transfer_params_refused_where_the_role_does_not_allow_them(server, runtime):
    d = runtime(*DECODE)
    async with aiohttp.ClientSession() as http:
        await started(http, d)
        status, answer = await post(
            http, server.url, "/v1/completions", {**body("hi"), "kv_transfer_params": {"do_remote_decode": True}}
        )
        assert status == 400 and answer["error"]["param"] == "kv_transfer_params", answer
        assert "--kv-transfer-role none" in answer["error"]["message"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status, answer = await post(
            http, server.url, "/v1/chat/completions", {**chat, "kv_transfer_params": {"do_remote_prefill": True}}
        )
        assert status == 400 and answer["error"]["param"] == "kv_transfer_params", answer
        for bad in (
            {"do_remote_decode": True},  # a decode runtime does not prefill for others
            {"do_remote_prefill": True, "remote_host": "127.0.0.1"},  # the hand-off's fields are missing
            "yes",
        ):
            status, answer = await post(http, d.url, "/v1/completions", {**body("hi"), "kv_transfer_params": bad})
            assert status == 400 and answer["error"]["param"] == "kv_transfer_params", (bad, answer)
        await wait_idle(http, d.url)
