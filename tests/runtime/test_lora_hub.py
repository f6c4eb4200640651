"""hf:// adapter sources: fetched with huggingface_hub into the disk cache, through the load route and on
first use under --lora-source hf://ORG. The Hub cannot be reached from here: a local HTTP server answering
its file-resolve routes (hub_standin.py) stands in for it, reached through HF_ENDPOINT as the Hub would be."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers import wait_for
from hub_standin import HubStandIn
from lora_adapters import make_adapter, peft_greedy

from goodput_runtime.engine import async_engine


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path) -> dict[str, Path]:
    return {
        "qvd4": make_adapter(tiny_model_dir, "qvd4", 4, ["q_proj", "v_proj", "down_proj"], rslora=True, seed=1),
        "mlp16": make_adapter(tiny_model_dir, "mlp16", 16, ["gate_proj", "up_proj", "down_proj"], seed=2),
    }


@pytest.fixture
def hub(adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubStandIn]:
    running = HubStandIn().start()
    running.add("org/qvd4", adapters["qvd4"])
    running.add("org/mlp16", adapters["mlp16"])
    running.add("org/readme-only", files={"README.md": b"# a model card, no adapter\n"})
    config = (adapters["qvd4"] / "adapter_config.json").read_bytes()
    running.add("org/corrupt", files={"adapter_config.json": config, "adapter_model.safetensors": b"\x10\0not one"})
    monkeypatch.setenv("HF_ENDPOINT", running.url)
    monkeypatch.setenv("GOODPUT_LORA_CACHE", str(tmp_path / "lora-cache"))
    yield running
    running.stop()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def tokens(client: openai.OpenAI, model: str, prompt: list[int], n: int = 6) -> list[str]:
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=n, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].logprobs.tokens


def expected(model_dir: Path, adapter: Path, prompt: list[int], n: int = 6) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.decode([t]) for t in peft_greedy(model_dir, adapter, prompt, n)]


def test_an_hf_adapter_is_fetched_into_the_disk_cache_and_served_then_loads_again_without_the_hub(
    make_server, tiny_model_dir, adapters, hub, tmp_path
):
    server = make_server(enable_lora=True, max_lora_rank=16, allow_runtime_lora_updating=True)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    loaded = post(server.url, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "hf://org/qvd4"})
    assert loaded.status_code == 200, loaded.text
    assert any("/org/qvd4/resolve/main/adapter_model.safetensors" in r for r in hub.requests)
    cached = list((tmp_path / "lora-cache").rglob("adapter_model.safetensors"))
    assert len(cached) == 1
    assert cached[0].read_bytes() == (adapters["qvd4"] / "adapter_model.safetensors").read_bytes()
    prompt = list(range(9, 25))
    assert tokens(client, "sql", prompt) == expected(tiny_model_dir, adapters["qvd4"], prompt)

    hub.stop()  # the Hub gone: the same source loads again from the disk cache
    again = post(
        server.url, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "hf://org/qvd4", "load_inplace": True}
    )
    assert again.status_code == 200, again.text
    assert tokens(client, "sql", prompt) == expected(tiny_model_dir, adapters["qvd4"], prompt)


def test_bad_hf_sources_are_refused_naming_the_cause(make_server, hub):
    server = make_server(enable_lora=True, max_lora_rank=8, allow_runtime_lora_updating=True)
    cases = {
        "hf://org/absent": (404, "no such repository"),
        "hf://org/readme-only": (400, "is not a PEFT adapter: it has no adapter_config.json"),
        "hf://org/corrupt": (400, "adapter_model.safetensors is corrupt"),
        "hf://org/qvd4@v2": (404, "no revision 'v2'"),
        "hf://org/mlp16": (400, "rank 16, above the maximum of 8"),
        "hf://just-a-name": (400, "is not hf://ORG/REPO"),
    }
    for source, (status, cause) in cases.items():
        response = post(server.url, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": source})
        assert response.status_code == status, (source, response.text)
        error = response.json()["error"]
        assert cause in error["message"] and error["param"] == "lora_path", (source, error)
    assert "bad" not in {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}


def test_under_an_hf_source_an_adapter_loads_on_first_use_and_a_slow_hub_is_a_503_while_steps_go_on(
    make_server, tiny_model_dir, adapters, hub, monkeypatch
):
    monkeypatch.setattr(async_engine, "LORA_LOAD_TIMEOUT_S", 2.0)  # the bound a request waits for a load
    server = make_server(lora_source="hf://org", max_lora_rank=16)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = list(range(9, 25))
    assert tokens(client, "qvd4", prompt) == expected(tiny_model_dir, adapters["qvd4"], prompt)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="absent", prompt="hi", max_tokens=2)
    assert "no such repository" in missing.value.message

    hub.delay = 5.0  # four requests to the Hub: the load takes 20 s, ten times the bound
    with pytest.raises(openai.InternalServerError) as slow:
        client.completions.create(model="mlp16", prompt="hi", max_tokens=2)
    assert slow.value.status_code == 503 and "still loading" in slow.value.message
    # meanwhile the step loop runs: base-model requests complete while the load is still under way
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = [pool.submit(tokens, client, "tiny", prompt, 4) for _ in range(2)]
        assert all(len(job.result(timeout=60)) == 4 for job in done)
    assert "mlp16" not in {m.id for m in client.models.list().data}, "the load finished first: the test proves nothing"
    wait_for(lambda: "mlp16" in {m.id for m in client.models.list().data}, timeout=120)
    assert tokens(client, "mlp16", prompt) == expected(tiny_model_dir, adapters["mlp16"], prompt)
    assert server.metric("goodput_lora_loads_total", result="ok") == 2
