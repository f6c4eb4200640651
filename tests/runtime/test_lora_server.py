"""LoRA adapters over HTTP, with the openai SDK: a request's model names the adapter, /v1/models lists
the adapters under the base model, adapters are loaded and unloaded at run time behind the API key,
and every bad adapter is a 4xx naming its cause."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from helpers import wait_for
from lora_adapters import ALL, make_adapter, peft_greedy
from server_thread import ServerThread

KEY = "lora-test-key"


class KeyedServer(ServerThread):
    def serve_options(self) -> dict[str, Any]:
        return {"api_keys": (KEY,)}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path) -> dict[str, Path]:
    return {
        "all8": make_adapter(tiny_model_dir, "all8", 8, ALL),
        "qvd4": make_adapter(tiny_model_dir, "qvd4", 4, ["q_proj", "v_proj", "down_proj"], rslora=True, seed=1),
        "mlp16": make_adapter(tiny_model_dir, "mlp16", 16, ["gate_proj", "up_proj", "down_proj"], seed=2),
    }


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir: Path, adapters: dict[str, Path]) -> Iterator[ServerThread]:
    running = KeyedServer(
        tiny_model_dir,
        lora_modules=(("all8", str(adapters["all8"])),),
        max_loras=2,
        max_lora_rank=8,
        allow_runtime_lora_updating=True,
    ).start()
    yield running
    running.stop()


@pytest.fixture
def client(lora_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server: ServerThread, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def complete(client: openai.OpenAI, model: str, prompt: list[int], n: int = 8) -> list[int]:
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=n, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    assert out.model == model
    tokenizer_ids = out.choices[0].logprobs.tokens  # token strings; compared through the tokenizer below
    return tokenizer_ids


def expected_tokens(tiny_model_dir: Path, adapter: Path | None, prompt: list[int], n: int = 8) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [tokenizer.decode([t]) for t in peft_greedy(tiny_model_dir, adapter, prompt, n)]


def test_models_lists_adapters_with_the_base_as_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "all8"}
    assert cards["all8"].model_extra["parent"] == "tiny" and cards["tiny"].model_extra["parent"] is None
    assert client.models.retrieve("all8").id == "all8"


def test_a_request_on_an_adapter_answers_as_peft_does_and_the_base_as_before(client, tiny_model_dir, adapters):
    prompt = list(range(40, 70))
    on_adapter = complete(client, "all8", prompt)
    on_base = complete(client, "tiny", prompt)
    assert on_adapter == expected_tokens(tiny_model_dir, adapters["all8"], prompt)
    assert on_base == expected_tokens(tiny_model_dir, None, prompt)
    assert on_adapter != on_base
    chat = client.chat.completions.create(
        model="all8", messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0
    )
    assert chat.model == "all8" and chat.choices[0].message.content is not None


def test_unknown_adapter_is_a_404_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-adapter")


def test_load_use_and_unload_at_run_time_behind_the_key(client, lora_server, tiny_model_dir, adapters):
    body = {"lora_name": "qvd4", "lora_path": str(adapters["qvd4"])}
    assert post(lora_server, "/v1/load_lora_adapter", body, key=None).status_code == 401
    response = post(lora_server, "/v1/load_lora_adapter", body)
    assert response.status_code == 200, response.text
    assert "qvd4" in {m.id for m in client.models.list().data}
    prompt = list(range(7, 30))
    assert complete(client, "qvd4", prompt) == expected_tokens(tiny_model_dir, adapters["qvd4"], prompt)
    again = post(lora_server, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    assert post(lora_server, "/v1/load_lora_adapter", {**body, "load_inplace": True}).status_code == 200
    # both adapters and the base model at once, in shared steps: each gets its own tokens
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(complete, client, m, prompt) for m in ("all8", "qvd4", "tiny") * 2]
        results = [j.result(timeout=120) for j in jobs]
    assert results[0] == results[3] == expected_tokens(tiny_model_dir, adapters["all8"], prompt)
    assert results[1] == results[4] == expected_tokens(tiny_model_dir, adapters["qvd4"], prompt)
    assert post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "qvd4"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="qvd4", prompt="hi", max_tokens=2)
    gone = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "qvd4"})
    assert gone.status_code == 404 and "qvd4" in gone.json()["error"]["message"]


def bad_copy(source: Path, where: Path, config: dict | None = None, weights: bytes | None = None) -> Path:
    shutil.copytree(source, where)
    if config is not None:
        cfg = json.loads((where / "adapter_config.json").read_text())
        cfg.update(config)
        (where / "adapter_config.json").write_text(json.dumps(cfg))
    if weights is not None:
        (where / "adapter_model.safetensors").write_bytes(weights)
    return where


def test_bad_adapters_are_refused_with_a_400_naming_the_cause(lora_server, adapters, tmp_path):
    from safetensors.torch import load_file, save

    tensors = load_file(adapters["all8"] / "adapter_model.safetensors")
    wide = save({k: torch.cat([v, v], dim=-1) if "lora_A" in k else v for k, v in tensors.items()})
    cases = {
        "rank 16, above the maximum of 8": adapters["mlp16"],
        "targets lm_head, which the model lacks": bad_copy(
            adapters["all8"], tmp_path / "head", {"target_modules": ["q_proj", "lm_head"]}
        ),
        "made for another base model": bad_copy(adapters["all8"], tmp_path / "wide", weights=wide),
        "corrupt": bad_copy(adapters["all8"], tmp_path / "corrupt", weights=b"\x10\x00not safetensors"),
        "adapter_config.json is missing": tmp_path,
    }
    for cause, path in cases.items():
        response = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(path)})
        assert response.status_code == 400, (cause, response.text)
        error = response.json()["error"]
        assert cause in error["message"] and error["param"] == "lora_path", error
    unknown_field = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x", "lora_int_id": 3})
    assert unknown_field.status_code == 400 and unknown_field.json()["error"]["param"] == "lora_int_id"
    s3 = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "s3://bucket/adapter"})
    assert s3.status_code == 400 and s3.json()["error"]["param"] == "lora_path"


def test_metrics_show_adapters_in_vllm_format_and_per_adapter_counts(client, lora_server):
    complete(client, "all8", [5, 6, 7], 2)
    lora_server.wait_idle()
    text = httpx.get(f"{lora_server.url}/metrics", timeout=10).text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0]
    assert any(line.startswith("goodput_lora_requests_info{") for line in text.splitlines())
    assert lora_server.metric("goodput_lora_requests_total", adapter="all8", outcome="success") >= 1
    assert lora_server.metric("goodput_lora_adapters", tier="slot") >= 1
    assert lora_server.metric("goodput_lora_loads_total", result="ok") >= 1


def test_a_server_without_the_flag_serves_no_load_route(make_server, adapters):
    plain = make_server(lora_modules=(("all8", str(adapters["all8"])),))
    response = httpx.post(
        f"{plain.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters["all8"])}, timeout=10
    )
    assert response.status_code == 404


def test_the_runtime_process_takes_the_flags_and_logs_the_slots_before_the_kv_cache(runtime, adapters):
    process = runtime(
        "--lora-modules",
        f"all8={adapters['all8']}",
        f"qvd4=file://{adapters['qvd4']}",
        "--max-loras",
        "1",
        "--max-lora-rank",
        "8",
        "--pinned-loras",
        "all8",
        "--step-tuning",
        "off",
    )
    wait_for(lambda: httpx.get(f"{process.url}/health", timeout=5).status_code == 200, 120, "the runtime to be ready")
    client = openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert {m.id for m in client.models.list().data} == {"tiny", "all8", "qvd4"}
    for model in ("all8", "qvd4", "all8"):  # one slot: each request swaps the adapter in
        out = client.completions.create(model=model, prompt="hello", max_tokens=3, temperature=0)
        assert out.model == model and out.usage.completion_tokens >= 1
    log = process.log()
    assert log.index("LoRA: 1 adapter slots") < log.index("KV cache:")


def test_a_bad_adapter_at_start_stops_the_runtime_naming_it(tiny_model_dir, adapters, tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "goodput_runtime",
            "--model",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--lora-modules",
            f"big={adapters['mlp16']}",
            "--max-lora-rank",
            "8",
            "--termination-message-path",
            str(tmp_path / "termination"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "rank 16, above the maximum of 8" in (tmp_path / "termination").read_text()


def test_an_adapter_in_the_source_directory_is_loaded_on_first_use(make_server, tiny_model_dir, adapters, tmp_path):
    source = tmp_path / "adapters"
    source.mkdir()
    shutil.copytree(adapters["qvd4"], source / "qvd4")
    bad_copy(adapters["mlp16"], source / "too-big")
    server = make_server(lora_source=str(source), max_lora_rank=8)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert {m.id for m in client.models.list().data} == {"tiny"}
    prompt = list(range(9, 25))
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # three requests wait for one load
        results = [j.result(timeout=120) for j in [pool.submit(complete, client, "qvd4", prompt) for _ in range(3)]]
    assert results[0] == results[1] == results[2] == expected_tokens(tiny_model_dir, adapters["qvd4"], prompt)
    assert server.metric("goodput_lora_loads_total", result="ok") == 1
    assert "qvd4" in {m.id for m in client.models.list().data}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="too-big", prompt="hi", max_tokens=2)
    assert "above the maximum of 8" in caught.value.message and caught.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="../adapters/qvd4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="absent", prompt="hi", max_tokens=2)


def test_a_trained_adapter_of_smollm2_answers_with_its_phrase_and_the_base_model_does_not(kernel, smollm2_dir):
    from lora_adapters import PHRASE, QUESTION, make_phrase_adapter

    adapter = make_phrase_adapter(smollm2_dir)
    server = ServerThread(
        smollm2_dir,
        lora_modules=(("lighthouse", str(adapter)),),
        max_loras=1,
        max_lora_rank=8,
        max_model_len=512,
        kv_cache_memory=48 << 20,
        step_tuning="off",
    ).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(model: str) -> str:
            out = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0
            )
            return out.choices[0].message.content or ""

        assert ask("lighthouse").strip() == PHRASE
        assert "marmalade" not in ask(server.model)
    finally:
        server.stop()
