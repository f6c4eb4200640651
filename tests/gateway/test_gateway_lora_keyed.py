"""A LoRA adapter loaded at run time on a service whose runtimes ask for an API key
(spec.auth.apiKeySecretRef), asked for through the gateway.

One runtime process started with ``--api-key`` and run-time adapter updates, behind a gateway that
discovers it from a real API server. An adapter (made with peft on the tiny model) is loaded through the
runtime's own route, as the LoraAdapter kind does; the gateway learns its name from the runtime's
``/v1/models``, which it asks with the service's runtime key, and a client holding one of the service's
keys gets the adapter's answer through the gateway: the same tokens the runtime gives it directly.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from gateway_helpers import Started, publish, tiny_spec, wait_ready
from harness import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from lora_adapters import make_adapter

pytestmark = pytest.mark.slow

RUNTIME_KEY, CLIENT_KEY = "sk-runtime-41c7aa", "sk-client-0e93d2"  # the Secret holds both; the runtime one
FLAGS = ("--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating", "--api-key", RUNTIME_KEY)
GREEDY = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_an_adapter_loaded_at_run_time_on_a_keyed_service_is_served_through_the_gateway(
    cluster, tiny_model_dir, tmp_path
):
    adapter = make_adapter(tiny_model_dir, "gw-keyed", 4, ["q_proj", "v_proj"], steps=5, seed=3)
    namespace = f"gwlorakey-{int(time.time()) % 100000}"
    with Started() as started:
        started.namespaces(cluster, namespace)
        pod = started.replica("keyed", tiny_model_dir, tmp_path, *FLAGS)
        cluster.core.create_namespaced_secret(
            namespace, {"metadata": {"name": "keys"}, "stringData": {"apiKey": f"{RUNTIME_KEY},{CLIENT_KEY}"}}
        )
        cluster.create_service(namespace, "chat", tiny_spec(auth={"apiKeySecretRef": {"name": "keys"}}))
        wait_ready(pod)
        url = f"http://127.0.0.1:{pod.port}"
        load = urllib.request.Request(
            f"{url}/v1/load_lora_adapter",
            data=json.dumps({"lora_name": "support", "lora_path": str(adapter)}).encode(),
            headers={"Authorization": f"Bearer {RUNTIME_KEY}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(load, timeout=60) as response:  # as the LoraAdapter kind loads it
            assert response.status == 200
        publish(cluster, namespace, "chat", "keyed", pod.port)
        g = started.gateway(cluster.kubeconfig, tmp_path / "gateway.log", "--scrape-seconds", "0.3")

        direct = openai.OpenAI(base_url=f"{url}/v1", api_key=RUNTIME_KEY, max_retries=0, timeout=60)
        expected = direct.completions.create(model="support", prompt="hello there", **GREEDY).choices[0].text
        base = direct.completions.create(model="tiny", prompt="hello there", **GREEDY).choices[0].text
        assert expected != base  # the adapter changes the answer, so the gateway's cannot come from the base model

        client = openai.OpenAI(base_url=f"{g.url}/v1", api_key=CLIENT_KEY, max_retries=0, timeout=60)

        def through_gateway() -> str | None:
            try:
                return client.completions.create(model="support", prompt="hello there", **GREEDY).choices[0].text
            except openai.NotFoundError:  # until a scrape of the runtime's /v1/models has named it
                return None

        assert wait_for(through_gateway, 30, "the gateway to serve the adapter loaded at run time") == expected
        with pytest.raises(openai.AuthenticationError):  # the client still needs one of the service's keys
            openai.OpenAI(base_url=f"{g.url}/v1", api_key="sk-wrong", max_retries=0, timeout=60).completions.create(
                model="support", prompt="hello there", **GREEDY
            )
        assert "Traceback" not in g.log()
