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
        ({"adapters": [{"name": "a", "source": "hf://org/adapter"}]}, "spec.model.lora.adapters[0].source", "pvc://"),
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
