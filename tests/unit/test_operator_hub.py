"""Fetching config.json over HTTP: in the background, cached, with the token, errors as answers."""

import asyncio

from aiohttp import web

from goodput_operator.hub import ConfigFetcher

CONFIG = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


async def _hub(requests):
    async def config(request):
        requests.append((request.match_info["repo"], request.headers.get("Authorization")))
        if request.match_info["repo"] == "acme/gated" and request.headers.get("Authorization") != "Bearer s3cret":
            return web.json_response({"error": "gated"}, status=401)
        if request.match_info["repo"] == "acme/slow":
            await asyncio.sleep(1.5)
        return web.json_response(CONFIG)

    app = web.Application()
    app.router.add_get("/{repo:.+}/resolve/{rev}/config.json", config)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def _no_token():
    return None


async def test_lookup_answers_at_once_then_notifies_and_caches():
    requests, ready = [], asyncio.Event()
    notified = []
    runner, endpoint = await _hub(requests)
    fetcher = ConfigFetcher(endpoint, on_ready=lambda waiters: (notified.append(waiters), ready.set()))
    try:
        assert fetcher.lookup("acme/tiny", "main", _no_token, ("ns", "a")) is None
        assert fetcher.lookup("acme/tiny", "main", _no_token, ("ns", "b")) is None
        await asyncio.wait_for(ready.wait(), 5)
        assert notified == [{("ns", "a"), ("ns", "b")}]
        result = fetcher.lookup("acme/tiny", "main", _no_token, ("ns", "a"))
        assert result.config.num_kv_heads == 2
        assert len(requests) == 1  # one download for both services, then the cache
    finally:
        await runner.cleanup()


async def test_gated_model_needs_the_token():
    requests, ready = [], asyncio.Event()
    runner, endpoint = await _hub(requests)
    fetcher = ConfigFetcher(endpoint, retry_seconds=0, on_ready=lambda _: ready.set())

    async def token():
        return "s3cret"

    try:
        fetcher.lookup("acme/gated", "main", _no_token, ("ns", "a"))
        await asyncio.wait_for(ready.wait(), 5)
        refused = fetcher.lookup("acme/gated", "main", _no_token, ("ns", "a"))
        assert "401" in refused.error and "tokenSecretRef" in refused.error
        ready.clear()
        await asyncio.wait_for(ready.wait(), 5)  # the error was old enough to retry at once
        ready.clear()
        fetcher.lookup("acme/gated", "v2", token, ("ns", "a"))
        await asyncio.wait_for(ready.wait(), 5)
        assert fetcher.lookup("acme/gated", "v2", token, ("ns", "a")).config is not None
        assert ("acme/gated", "Bearer s3cret") in requests
    finally:
        await runner.cleanup()


async def test_timeout_is_an_answer_not_a_hang():
    requests, ready = [], asyncio.Event()
    runner, endpoint = await _hub(requests)
    fetcher = ConfigFetcher(endpoint, timeout_seconds=0.3, on_ready=lambda _: ready.set())
    try:
        fetcher.lookup("acme/slow", "main", _no_token, ("ns", "a"))
        await asyncio.wait_for(ready.wait(), 5)
        assert "Timeout" in fetcher.lookup("acme/slow", "main", _no_token, ("ns", "a")).error
    finally:
        await fetcher.close()
        await runner.cleanup()
