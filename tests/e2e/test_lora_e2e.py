"""A LoRA adapter loaded at run time on the real node, and asked for through the gateway.

The InferenceService `tuned` serves the real SmolLM2 from the tier's models volume, with run-time
adapter updates allowed. A `LoraAdapter` names an adapter trained here with peft (tests/runtime/
lora_adapters.py: it answers one fixed question with a phrase the base model never says), on the same
claim. What a user would see is asserted, with the official `openai` SDK through the gateway's ClusterIP:

- the LoraAdapter becomes Ready, its status naming the replica that holds it;
- a chat completion naming the adapter answers with the trained phrase, and the base model does not;
- deleting the LoraAdapter unloads it: the gateway answers the adapter's name with a 404 in OpenAI's
  shape, and the base model still serves.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import openai
import pytest
from node import OPERATOR_NAMESPACE, ROOT, Node, cluster_ip, condition, copy_model, wait_for

sys.path.insert(0, str(ROOT / "tests" / "runtime"))
from lora_adapters import PHRASE, QUESTION, make_phrase_adapter

pytestmark = pytest.mark.slow

NAME = "tuned"
ADAPTER = "lighthouse"
READY_SECONDS = 420


def adapter_status(node: Node) -> dict[str, Any]:
    return (node.get("loraadapter", ADAPTER) or {}).get("status") or {}


def service_ready(node: Node) -> bool:
    svc = node.get("inferenceservice", NAME) or {}
    return condition(svc, "Ready").get("status") == "True" and svc.get("status", {}).get("readyReplicas") == 1


def ask(client: openai.OpenAI, model: str) -> str:
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0
    )
    return out.choices[0].message.content or ""


@pytest.fixture(scope="module")
def tuned(installed: Node, models: dict[str, Path], smollm2_dir: Path) -> Any:
    node = installed
    root = models["tiny"].parent  # the claim `models`: a hostPath volume, so files put here show in the pods
    copy_model(smollm2_dir, root / "smollm2")
    copy_model(make_phrase_adapter(smollm2_dir), root / ADAPTER)
    node.apply(
        {
            "apiVersion": "serving.goodput.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": NAME},
            "spec": {
                "model": {
                    "source": "pvc://models/smollm2",
                    "servedName": NAME,
                    "maxModelLen": 512,
                    "dtype": "float32",
                    "lora": {"runtimeUpdates": True, "maxAdapters": 1, "maxRank": 8},
                },
                "engine": {"maxNumSeqs": 4},
                "resources": {"gpu": 0, "cpu": "1", "memory": "3Gi"},
                "replicas": 1,
                "autoscaling": {"mode": "none"},
            },
        }
    )
    wait_for(lambda: service_ready(node), READY_SECONDS, "a Ready replica of tuned", explain=node.describe)
    base_url = f"http://{cluster_ip(node, 'goodput-gateway', OPERATOR_NAMESPACE)}/v1"
    yield node, openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    node.kubectl("delete", "loraadapter", ADAPTER, "--wait=false", check=False)
    node.kubectl("delete", "inferenceservice", NAME, "--wait=false", check=False)


def test_a_lora_adapter_loaded_at_run_time_answers_through_the_gateway_and_goes_when_deleted(tuned: Any) -> None:
    node, client = tuned
    node.apply(
        {
            "apiVersion": "serving.goodput.dev/v1alpha1",
            "kind": "LoraAdapter",
            "metadata": {"name": ADAPTER},
            "spec": {"service": NAME, "source": f"pvc://models/{ADAPTER}", "replicas": "all"},
        }
    )
    status = wait_for(
        lambda: (s := adapter_status(node)).get("phase") == "Ready" and s,
        READY_SECONDS,
        "the LoraAdapter to be Ready",
        explain=lambda: str(adapter_status(node)) + "\n" + node.describe(),
    )
    pods = [p["metadata"]["name"] for p in node.get("pods", selector=f"serving.goodput.dev/service={NAME}") or []]
    assert set(status["replicas"]) <= set(pods) and status["replicas"], (status, pods)

    def answered() -> str | None:  # the gateway learns the adapter from the replica's /v1/models
        try:
            return ask(client, ADAPTER)
        except openai.NotFoundError:
            return None

    assert wait_for(answered, 120, "the gateway to route the adapter").strip() == PHRASE
    assert "marmalade" not in ask(client, NAME)

    node.kubectl("delete", "loraadapter", ADAPTER, "--timeout=120s", timeout=150)

    def refused() -> openai.NotFoundError | None:
        try:
            ask(client, ADAPTER)
        except openai.NotFoundError as err:
            return err
        return None

    err = wait_for(refused, 120, "the gateway to answer the unloaded adapter with 404")
    assert err.status_code == 404 and ADAPTER in err.message
    assert "marmalade" not in ask(client, NAME)
