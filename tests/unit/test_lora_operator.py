"""spec.model.lora: parsed and refused by field, rendered as the runtime's and vLLM's LoRA flags (which
the runtime's own parser reads back), each pvc:// adapter's claim mounted read-only; refused for SGLang."""

from __future__ import annotations

import pytest
import yaml

from goodput_contract.api.spec import SpecError, parse
from goodput_operator import engines
from goodput_operator.builders import build_deployment, runtime_args
from goodput_operator.settings import Settings
from goodput_runtime.__main__ import build_parser, engine_config

LORA = {
    "adapters": [
        {"name": "support", "source": "pvc://adapters/support"},
        {"name": "sql", "source": "file:///opt/adapters/sql"},
    ],
    "maxAdapters": 2,
    "maxRank": 32,
    "maxCpuAdapters": 8,
}


def spec(lora: dict | None = LORA, kind: str = "goodput", gpu: int = 0) -> dict:
    return {
        "model": {"source": "hf://org/model", "servedName": "chat", **({"lora": lora} if lora is not None else {})},
        "engine": {"kind": kind},
        "resources": {"gpu": gpu},
    }


def test_goodput_runtime_gets_the_adapters_and_limits_and_parses_them():
    args = runtime_args(parse("svc", "ns", spec()))
    config = engine_config(build_parser().parse_args(args))
    assert config.enable_lora and config.max_loras == 2 and config.max_lora_rank == 32 and config.max_cpu_loras == 8
    assert config.lora_modules == (("support", "/mnt/loras/support/support"), ("sql", "/opt/adapters/sql"))
    assert "--enable-lora" not in runtime_args(parse("svc", "ns", spec(None)))


def test_vllm_gets_its_flags_of_the_same_names():
    args = runtime_args(parse("svc", "ns", spec(kind="vllm", gpu=1)))
    at = args.index("--lora-modules")
    assert "--enable-lora" in args and args[at + 1 : at + 3] == [
        "support=/mnt/loras/support/support",
        "sql=/opt/adapters/sql",
    ]
    assert args[args.index("--max-loras") + 1] == "2" and args[args.index("--max-cpu-loras") + 1] == "8"


def test_sglang_refuses_the_field_by_name():
    refusals = engines.refusals(parse("svc", "ns", spec(kind="sglang", gpu=1)))
    assert refusals[0][0] == "model.lora"


def test_each_pvc_adapter_is_mounted_read_only_under_its_name():
    deployment = build_deployment(parse("svc", "ns", spec()), Settings(), {"uid": "u"})
    pod = deployment["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "lora-0")
    assert volume["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "lora-0")
    assert mount == {"name": "lora-0", "mountPath": "/mnt/loras/support", "readOnly": True}
    assert not any(v["name"] == "lora-1" for v in pod["volumes"])  # a file:// adapter needs no volume


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"adapters": [{"name": "chat", "source": "file:///a"}]}, "spec.model.lora.adapters[0].name", "served name"),
        (
            {"adapters": [{"name": "a", "source": "file:///a"}, {"name": "a", "source": "file:///b"}]},
            "spec.model.lora.adapters[1].name",
            "another adapter",
        ),
        (
            {"adapters": [{"name": "a", "source": "hf://adapter"}]},
            "spec.model.lora.adapters[0].source",
            "hf://org/repo",
        ),
        (
            {"adapters": [{"name": "a", "source": "hf://org/a/b.gguf"}]},
            "spec.model.lora.adapters[0].source",
            "@revision",
        ),
        ({"adapters": [{"name": "a", "source": "s3://b/a"}]}, "spec.model.lora.adapters[0].source", "pvc://"),
        (
            {"adapters": [{"name": "a", "source": "file:///a", "tokenSecretRef": {"name": "hf"}}]},
            "spec.model.lora.adapters[0].tokenSecretRef",
            "only an hf:// source",
        ),
        (
            {"adapters": [{"name": "a", "source": "hf://org/a", "tokenSecretRef": {"name": "Bad_Name"}}]},
            "spec.model.lora.adapters[0].tokenSecretRef.name",
            "DNS subdomain",
        ),
        (
            {
                "adapters": [
                    {"name": "a", "source": "hf://org/a", "tokenSecretRef": {"name": "hf"}},
                    {"name": "b", "source": "hf://org/b", "tokenSecretRef": {"name": "hf", "key": "other"}},
                ]
            },
            "spec.model.lora.adapters[1].tokenSecretRef",
            "one token",
        ),
        ({"maxAdapters": 0}, "spec.model.lora.maxAdapters", "at least 1"),
        ({"maxAdapters": 4, "maxCpuAdapters": 2}, "spec.model.lora.maxCpuAdapters", "below maxAdapters"),
    ],
)
def test_bad_lora_fields_are_refused_naming_them(change, field, words):
    with pytest.raises(SpecError) as caught:
        parse("svc", "ns", spec(change))
    assert caught.value.field == field and words in str(caught.value)


def test_the_crd_describes_the_field():
    from pathlib import Path

    crd = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "crds" / "serving.goodput.dev_inferenceservices.yaml").read_text()
    )
    model = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]
    lora = model["properties"]["lora"]["properties"]
    assert set(lora) == {"adapters", "maxAdapters", "maxRank", "maxCpuAdapters", "runtimeUpdates"}
    assert lora["adapters"]["items"]["required"] == ["name", "source"]


HUB = {
    "adapters": [
        {"name": "support", "source": "hf://acme/support-lora@v2", "tokenSecretRef": {"name": "hub", "key": "hf"}},
        {"name": "sql", "source": "hf://acme/sql-lora"},
        {"name": "local", "source": "file:///opt/adapters/local"},
    ],
}


def env_of(svc_spec: dict) -> dict:
    pod = build_deployment(parse("svc", "ns", svc_spec), Settings(), {"uid": "u"})["spec"]["template"]["spec"]
    return {e["name"]: e for e in pod["containers"][0]["env"]}


def test_hub_adapters_reach_the_runtime_with_their_revision_and_the_token_by_reference():
    svc_spec = spec(HUB)
    config = engine_config(build_parser().parse_args(runtime_args(parse("svc", "ns", svc_spec))))
    assert config.lora_modules == (
        ("support", "hf://acme/support-lora@v2"),
        ("sql", "hf://acme/sql-lora"),
        ("local", "/opt/adapters/local"),
    )
    token = env_of(svc_spec)["HF_TOKEN"]  # from the Secret at container start, never in the pod spec
    assert token == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub", "key": "hf"}}}
    # the model's own token, where it names the same Secret key, is the one the pod gets
    same = spec(HUB)
    same["model"]["tokenSecretRef"] = {"name": "hub", "key": "hf"}
    assert env_of(same)["HF_TOKEN"] == token
    # no token anywhere: none in the pod
    public = spec({"adapters": [{"name": "sql", "source": "hf://acme/sql-lora"}]})
    assert "HF_TOKEN" not in env_of(public)


def test_a_hub_adapter_token_other_than_the_models_is_refused_naming_it():
    svc_spec = spec(HUB)
    svc_spec["model"]["tokenSecretRef"] = {"name": "model-token"}
    with pytest.raises(SpecError) as caught:
        parse("svc", "ns", svc_spec)
    assert caught.value.field == "spec.model.lora.adapters[0].tokenSecretRef"
    assert "model.tokenSecretRef" in str(caught.value)


def test_vllm_gets_hub_adapters_as_repository_ids_and_refuses_a_revision_by_field():
    public = {"adapters": [{"name": "sql", "source": "hf://acme/sql-lora"}]}
    args = runtime_args(parse("svc", "ns", spec(public, kind="vllm", gpu=1)))
    assert args[args.index("--lora-modules") + 1] == "sql=acme/sql-lora"
    refusals = engines.refusals(parse("svc", "ns", spec(HUB, kind="vllm", gpu=1)))
    assert refusals[0][0] == "model.lora.adapters" and "revision" in refusals[0][1]
    assert engines.refusals(parse("svc", "ns", spec(public, kind="vllm", gpu=1))) == []


def test_adapters_with_the_kv_hand_off_are_refused_naming_the_field():
    split = {**spec(), "disaggregation": {"prefill": {"minReplicas": 1}, "decode": {"minReplicas": 1}}}
    with pytest.raises(SpecError) as caught:
        engines.validate(parse("svc", "ns", split))
    assert caught.value.field == "spec.model.lora" and "spec.disaggregation" in str(caught.value)
    engines.validate(parse("svc", "ns", spec()))  # without the hand-off: served
