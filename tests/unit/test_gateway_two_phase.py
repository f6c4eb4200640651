"""Two-phase routing's decisions (goodput_gateway/disagg.py) through the proxy, over real HTTP.

The prefill and decode replicas here are small aiohttp servers that answer in the P/D interface's
shapes (the prefill phase's ``kv_transfer_params``) and record what they were sent: they stand in
for runtimes started with ``--kv-transfer-role``, whose own hand-off is tested in the runtime tier.
What is checked is the gateway's: which path a request takes, what each phase is sent, the fallback
on a failed or slow prefill, and the counters.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from goodput_gateway.disagg import DisaggSettings, TwoPhase, decode_body, prefill_body, uncached
from goodput_gateway.discovery import Registry, Split
from goodput_gateway.holding import Holds
from goodput_gateway.loads import LoadScraper
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.prompt_digests import PromptBlocks
from goodput_gateway.proxy import Proxy, ProxySettings

HANDOFF = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "e1",
    "remote_host": "127.0.0.1",
    "remote_port": 8001,
    "remote_request_id": "r1",
    "remote_block_ids": [3, 4],
    "num_tokens": 40,
    "layout_digest": "ab",
    "lease_seconds": 30.0,
    "block_digests": ["0" * 32, "1" * 32],
}
LONG = "word " * 400  # about 400 tokens by the gateway's estimate (characters / 4): 500


class Replica:
    """A server recording the bodies it is sent; `mode` shapes its answer."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode, self.bodies = mode, []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self.bodies.append(body)
        if self.mode == "fail":
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        if self.mode == "slow":
            await asyncio.sleep(5)
        answer: dict[str, Any] = {"object": "text_completion", "choices": [{"index": 0, "text": "x"}]}
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            answer["kv_transfer_params"] = HANDOFF
        return web.json_response(answer)

    async def start(self) -> Replica:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def proxy_for(session: aiohttp.ClientSession, decode: Replica, prefill: list[Replica], **settings: Any) -> Proxy:
    registry = Registry()
    registry.set_static(
        {"m": (decode.url,)}, "prefix", {"m": tuple(p.url for p in prefill)}, Split(threshold_tokens=256)
    )
    metrics = GatewayMetrics()
    scraper = LoadScraper(session, lambda: (), 10)
    proxy = Proxy(registry, Holds(registry, metrics, 10, 5), scraper, session, metrics, ProxySettings())
    proxy.disagg = TwoPhase(proxy, DisaggSettings(**settings))
    return proxy


async def send(proxy: Proxy, prompt: str, **extra: Any) -> dict:
    svc = proxy.registry.services[("static", "m")]
    body = {"model": "m", "prompt": prompt, "max_tokens": 7, "stream": True, "stream_options": {}, **extra}
    raw = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    async with proxy.open("POST", "/v1/completions", headers, svc, "m", raw, body) as upstream:
        return json.loads(await upstream.read())


def paths(proxy: Proxy) -> dict[str, float]:
    out = {}
    for metric in proxy.metrics.registry.collect():
        if metric.name == "goodput_gateway_disaggregation":
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["path"]] = sample.value
    return out


def test_each_phase_is_sent_what_the_interface_names():
    body = {"model": "m", "messages": [], "max_completion_tokens": 9, "stream": True, "n": 3, "stream_options": {}}
    first = prefill_body(body)
    assert first["kv_transfer_params"] == {"do_remote_decode": True}
    assert (first["max_tokens"], first["stream"], first["n"]) == (1, False, 1)
    assert "max_completion_tokens" not in first and "stream_options" not in first
    second = decode_body(body, HANDOFF)
    assert second["kv_transfer_params"] == HANDOFF and second["n"] == 3 and second["max_completion_tokens"] == 9
    blocks = PromptBlocks(4, 30, tuple(f"{i:032x}" for i in range(7)))
    assert uncached(blocks, {"device": {f"{i:032x}" for i in range(3)}, "offload": set()}, {}) == 18
    assert uncached(blocks, None, {}) == 30
    assert uncached(None, None, {"prompt": "abcd" * 10}) == 10


async def test_a_long_prompt_is_prefilled_on_the_prefill_pool_and_decoded_with_the_hand_off():
    decode, prefill = await Replica().start(), await Replica().start()
    try:
        async with aiohttp.ClientSession() as session:
            proxy = await proxy_for(session, decode, [prefill])
            await send(proxy, LONG)
            assert prefill.bodies[0]["kv_transfer_params"] == {"do_remote_decode": True}
            assert prefill.bodies[0]["max_tokens"] == 1 and prefill.bodies[0]["stream"] is False
            assert decode.bodies[0]["kv_transfer_params"] == HANDOFF
            assert decode.bodies[0]["max_tokens"] == 7 and decode.bodies[0]["stream"] is True
            await send(proxy, "short prompt")  # under the threshold: whole on the decode replica
            assert len(prefill.bodies) == 1 and "kv_transfer_params" not in decode.bodies[1]
            assert paths(proxy) == {"disaggregated": 1, "local": 1, "fallback": 0}
            histogram = proxy.metrics.handoff_seconds.labels("static", "m")
            assert histogram._sum.get() > 0  # the prefill phase's time was observed
    finally:
        await decode.stop()
        await prefill.stop()


async def test_a_failed_or_slow_prefill_falls_back_to_the_plain_request():
    decode, failing, slow = await Replica().start(), await Replica("fail").start(), await Replica("slow").start()
    try:
        async with aiohttp.ClientSession() as session:
            proxy = await proxy_for(session, decode, [failing])
            await send(proxy, LONG)
            assert len(failing.bodies) == 1 and "kv_transfer_params" not in decode.bodies[0]
            proxy = await proxy_for(session, decode, [slow], prefill_timeout=0.5)
            started = asyncio.get_running_loop().time()
            await send(proxy, LONG)
            assert asyncio.get_running_loop().time() - started < 4  # bounded by the prefill timeout, not 5 s
            assert "kv_transfer_params" not in decode.bodies[1]
            assert paths(proxy) == {"disaggregated": 0, "local": 0, "fallback": 1}
    finally:
        for r in (decode, failing, slow):
            await r.stop()


async def test_no_ready_or_a_queued_prefill_pool_serves_whole():
    decode, prefill = await Replica().start(), await Replica().start()
    try:
        async with aiohttp.ClientSession() as session:
            proxy = await proxy_for(session, decode, [])
            await send(proxy, LONG)
            proxy = await proxy_for(session, decode, [prefill], max_prefill_queue=2)
            proxy.outstanding[prefill.url] = 2  # two requests already on the one prefill replica
            await send(proxy, LONG)
            assert prefill.bodies == [] and paths(proxy)["local"] == 1
            # a client's own kv_transfer_params is passed on untouched, never split again
            proxy.outstanding[prefill.url] = 0
            await send(proxy, LONG, kv_transfer_params={"do_remote_decode": True})
            assert prefill.bodies == [] and decode.bodies[-1]["kv_transfer_params"] == {"do_remote_decode": True}
    finally:
        await decode.stop()
        await prefill.stop()
