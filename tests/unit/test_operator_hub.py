"""Fetching config.json over HTTP: in the background, cached, with the token, errors as answers."""

import asyncio

from aiohttp import web

from goodput_operator.hub import ConfigFetcher

CONFIG = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


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


def _gguf_file(path):
    import gguf as gguf_py
    import numpy as np

    writer = gguf_py.GGUFWriter(str(path), "llama")
    for add, value in [
        ("add_block_count", 2),
        ("add_context_length", 2048),
        ("add_embedding_length", 64),
        ("add_feed_forward_length", 128),
        ("add_head_count", 4),
        ("add_head_count_kv", 2),
        ("add_vocab_size", 1000),
    ]:
        getattr(writer, add)(value)
    writer.add_tensor("token_embd.weight", np.zeros((1000, 64), dtype=np.float32))  # 256 KB of tensor data
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


async def _gguf_hub(tmp_path, ranges):
    file = _gguf_file(tmp_path / "tiny.gguf")

    async def config(request):
        if request.match_info["repo"] == "acme/with-config":
            return web.json_response({**CONFIG, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 7})
        return web.json_response({"error": "not found"}, status=404)

    async def gguf_file(request):
        if request.match_info["file"] != "tiny.gguf":
            return web.json_response({"error": "not found"}, status=404)
        ranges.append(request.headers.get("Range"))
        return web.FileResponse(file)

    app = web.Application()
    app.router.add_get("/{repo:.+}/resolve/{rev}/config.json", config)
    app.router.add_get("/{repo:.+}/resolve/{rev}/{file}", gguf_file)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def _answer(fetcher, repo, file):
    ready = asyncio.Event()
    fetcher._on_ready = lambda _: ready.set()
    assert fetcher.lookup(repo, "main", _no_token, ("ns", repo), file) is None
    await asyncio.wait_for(ready.wait(), 5)
    return fetcher.lookup(repo, "main", _no_token, ("ns", repo), file)


async def test_a_gguf_source_is_sized_from_its_repos_config_json_else_its_header(tmp_path, monkeypatch):
    from goodput_operator import hub

    ranges = []
    runner, endpoint = await _gguf_hub(tmp_path, ranges)
    fetcher = ConfigFetcher(endpoint, retry_seconds=0)
    try:
        with_config = await _answer(fetcher, "acme/with-config", "tiny.gguf")
        assert with_config.config.num_layers == 7 and ranges == []  # config.json wins; the file is not read
        bare = await _answer(fetcher, "acme/bare", "tiny.gguf")
        assert bare.error is None
        assert (bare.config.architectures, bare.config.num_layers, bare.config.vocab_size) == (
            ("LlamaForCausalLM",),
            2,
            1000,
        )
        assert ranges == [f"bytes=0-{hub.GGUF_HEADER_BYTES - 1}"]  # a range request, not the whole file
        missing = await _answer(fetcher, "acme/bare", "other.gguf")
        assert "acme/bare has no config.json, and its GGUF file answered HTTP 404" in missing.error
        monkeypatch.setattr(hub, "GGUF_HEADER_BYTES", 64)
        short = await _answer(ConfigFetcher(endpoint), "acme/bare", "tiny.gguf")
        assert "the header of tiny.gguf cannot be read from its first 64 bytes" in short.error
    finally:
        await runner.cleanup()
