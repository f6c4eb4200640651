"""The table of engines: each CR field reaches vLLM and SGLang under their own flags, or is refused naming it."""

import asyncio
import json

import pytest
from operator_fakes import FakeContext

from goodput_contract import flags
from goodput_contract.api.spec import SpecError, parse
from goodput_operator import engines
from goodput_operator.builders import build_deployment, owner_reference, runtime_args
from goodput_operator.conditions import find
from goodput_operator.reconcile import _reconcile
from goodput_operator.settings import Settings

OWNER = owner_reference("chat", "0000-uid")
SETTINGS = Settings(
    runtime_image="registry.local/goodput-runtime:test",
    vllm_image="registry.local/vllm:gpu",
    vllm_cpu_image="registry.local/vllm:cpu",
    sglang_image="registry.local/sglang:test",
)


def full(kind: str, **engine) -> dict:
    return {
        "model": {
            "source": "hf://Qwen/Qwen2.5-7B-Instruct",
            "revision": "v1",
            "servedName": "qwen",
            "maxModelLen": 8192,
            "dtype": "bfloat16",
            "quantization": "fp8",
        },
        "engine": {
            "kind": kind,
            "maxNumSeqs": 128,
            "maxBatchedTokens": 4096,
            "prefixCaching": True,
            "gpuMemoryUtilization": 0.85,
            "extraArgs": ["--seed", "7"],
            **engine,
        },
        "parallelism": {"tensor": 2},
        "resources": {"gpu": 2, "memory": "64Gi"},
        "slo": {"ttft": "300ms", "tpot": "45ms"},
    }


def svc(spec: dict):
    parsed = parse("chat", "ns", spec)
    engines.validate(parsed)
    return parsed


def test_vllm_command_line_carries_every_field_under_its_own_flag():
    args = runtime_args(svc(full("vllm")))
    buckets = args.index("--custom-histogram-buckets")
    assert args[:buckets] == [
        "--model",
        "Qwen/Qwen2.5-7B-Instruct",
        "--served-model-name",
        "qwen",
        "--revision",
        "v1",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "8192",
        "--max-num-seqs",
        "128",
        "--max-num-batched-tokens",
        "4096",
        "--gpu-memory-utilization",
        "0.85",
        "--tensor-parallel-size",
        "2",
        "--quantization",
        "fp8",
        "--enable-prefix-caching",
    ]
    assert args[buckets + 2 :] == ["--seed", "7"]  # extraArgs last, so they win over derived flags
    families = json.loads(args[buckets + 1])
    # the SLOs are bucket boundaries; vLLM's own boundaries stay around them
    assert 0.3 in families["time_to_first_token"] and 0.25 in families["time_to_first_token"]
    assert 0.045 in families["inter_token_latency"] and 0.05 in families["inter_token_latency"]
    for bounds in families.values():
        assert bounds == sorted(set(bounds))


def test_sglang_command_line_carries_every_field_under_its_own_flag():
    args = runtime_args(svc(full("sglang", maxQueue=64)))
    ttft = args.index("--bucket-time-to-first-token")
    assert args[:ttft] == [
        "--model-path",
        "Qwen/Qwen2.5-7B-Instruct",
        "--served-model-name",
        "qwen",
        "--revision",
        "v1",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--enable-metrics",
        "--dtype",
        "bfloat16",
        "--context-length",
        "8192",
        "--max-running-requests",
        "128",
        "--chunked-prefill-size",
        "4096",
        "--mem-fraction-static",
        "0.85",
        "--max-queued-requests",
        "64",
        "--tp-size",
        "2",
        "--quantization",
        "fp8",
    ]
    tpot = args.index("--bucket-inter-token-latency")
    assert "0.3" in args[ttft + 1 : tpot] and "0.2" in args[ttft + 1 : tpot]
    assert "0.045" in args[tpot + 1 :] and args[-2:] == ["--seed", "7"]


@pytest.mark.parametrize(
    ("kind", "on", "off"),
    [
        ("goodput", ["--enable-prefix-caching"], ["--no-enable-prefix-caching"]),
        ("vllm", ["--enable-prefix-caching"], ["--no-enable-prefix-caching"]),
        ("sglang", [], ["--disable-radix-cache"]),  # SGLang's radix cache is on unless disabled
    ],
)
def test_prefix_caching_both_ways(kind, on, off):
    def caching(value):
        args = runtime_args(
            svc(
                {
                    "model": {"source": "hf://org/m"},
                    "engine": {"kind": kind, "prefixCaching": value},
                    "resources": {"gpu": 1},
                }
            )
        )
        return [a for a in args if "prefix-caching" in a or "radix" in a]

    assert caching(True) == on
    assert caching(False) == off


def test_without_slo_vllm_keeps_its_default_buckets_and_sglang_its_own():
    spec = {"model": {"source": "hf://org/m"}, "resources": {"gpu": 1}}
    assert "--custom-histogram-buckets" not in runtime_args(svc({**spec, "engine": {"kind": "vllm"}}))
    args = runtime_args(svc({**spec, "engine": {"kind": "sglang"}}))
    assert not any(a.startswith("--bucket-") for a in args)


def test_vllm_with_only_a_ttft_target_sets_only_that_family():
    args = runtime_args(
        svc(
            {
                "model": {"source": "hf://org/m"},
                "engine": {"kind": "vllm"},
                "resources": {"gpu": 1},
                "slo": {"ttft": "2s"},
            }
        )
    )
    assert list(json.loads(args[args.index("--custom-histogram-buckets") + 1])) == ["time_to_first_token"]


def test_every_field_our_runtime_takes_is_mapped_or_refused_by_each_engine():
    """No CR field is dropped silently: the other engines name a flag for each, or refuse it (tested below)."""
    handled_otherwise = {
        "vllm": {"resources.gpu": "the image: VLLM_CPU_IMAGE for 0 GPUs", "engine.maxQueue": "refused"},
        "sglang": {"resources.gpu": "0 GPUs refused"},
    }
    for kind in handled_otherwise:  # engine.speculative is refused as a whole (test_spec_operator.py)
        handled_otherwise[kind].update(
            dict.fromkeys(
                ("engine.speculative.method", "engine.speculative.tokens", "engine.speculative.draftModel"), "refused"
            )
        )
    for kind, table in (("vllm", engines.VLLM_FLAGS), ("sglang", engines.SGLANG_FLAGS)):
        for field in flags.CR_FIELD_FLAGS:
            assert field in table or field in handled_otherwise[kind], (kind, field)


@pytest.mark.parametrize(
    ("kind", "change", "field"),
    [
        ("vllm", {"model": {"quantization": "int8"}}, "spec.model.quantization"),
        ("vllm", {"model": {"quantization": "int8-w8a8"}}, "spec.model.quantization"),
        ("vllm", {"engine": {"maxQueue": 32}}, "spec.engine.maxQueue"),
        ("vllm", {"model": {"source": "hf://acme/tiny-GGUF/tiny.Q4_K_M.gguf"}}, "spec.model.source"),
        ("sglang", {"model": {"quantization": "int8"}}, "spec.model.quantization"),
        ("sglang", {"resources": {"gpu": 0}}, "spec.resources.gpu"),
        ("sglang", {"model": {"source": "hf://acme/tiny-GGUF/tiny.Q4_K_M.gguf"}}, "spec.model.source"),
        ("vllm", {"image": "a:1", "engine": {"image": "b:2"}}, "spec.engine.image"),
    ],
)
def test_a_field_the_engine_cannot_honour_is_refused_naming_it(kind, change, field):
    spec = {"model": {"source": "hf://org/m"}, "engine": {"kind": kind}, "resources": {"gpu": 1}}
    for key, value in change.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) and key in spec else value
    with pytest.raises(SpecError) as err:
        svc(spec)
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")


def test_our_runtime_still_takes_what_the_others_refuse():
    svc(
        {
            "model": {"source": "hf://acme/tiny-GGUF/tiny.Q4_K_M.gguf", "quantization": "int8"},
            "engine": {"maxQueue": 32},
            "resources": {"gpu": 0},
        }
    )


def test_refusal_is_valid_false_with_the_field_and_an_event():
    ctx = FakeContext()
    body = {
        "metadata": {"namespace": "ns", "name": "chat", "uid": "u", "generation": 1},
        "spec": {"model": {"source": "hf://org/m", "quantization": "int8"}, "engine": {"kind": "vllm"}},
        "status": {},
    }
    assert asyncio.run(_reconcile(ctx, body)) == "invalid"
    (status,) = ctx.kube.statuses
    valid = find(status["conditions"], "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "EngineUnsupportedField")
    assert valid["message"].startswith("spec.model.quantization: cannot be honoured by engine.kind vllm")
    assert [(t, r) for t, r, _ in ctx.events] == [("Warning", "Invalid")]


def test_vllm_deployment_runs_vllm_with_its_probes_shared_memory_and_a_drain_delay():
    deployment = build_deployment(svc(full("vllm")), SETTINGS, OWNER)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.local/vllm:gpu"
    assert container["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert container["args"][:2] == ["--model", "Qwen/Qwen2.5-7B-Instruct"]
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # minutes to download, load and compile before the first health check may pass
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 1800
    assert container["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HF_HOME"] == "/var/cache/goodput/hf" and env["HOME"] == "/tmp"
    assert env["VLLM_CACHE_ROOT"].startswith("/var/cache/goodput/")
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_vllm_on_cpu_takes_the_cpu_image_and_an_image_override_wins():
    spec = {"model": {"source": "hf://org/m"}, "engine": {"kind": "vllm"}, "resources": {"gpu": 0}}
    (container,) = build_deployment(svc(spec), SETTINGS, OWNER)["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.local/vllm:cpu"
    spec["engine"]["image"] = "mirror.local/vllm:pinned"
    (container,) = build_deployment(svc(spec), SETTINGS, OWNER)["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "mirror.local/vllm:pinned"


def test_sglang_deployment_and_our_runtime_keeps_its_own_drain():
    (sg,) = build_deployment(svc(full("sglang")), SETTINGS, OWNER)["spec"]["template"]["spec"]["containers"]
    assert (sg["image"], sg["command"]) == ("registry.local/sglang:test", ["python3", "-m", "sglang.launch_server"])
    assert sg["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    (ours,) = build_deployment(svc(full("goodput")), SETTINGS, OWNER)["spec"]["template"]["spec"]["containers"]
    assert ours["command"] == ["python3", "-m", "goodput_runtime"] and "lifecycle" not in ours
    assert ours["image"] == "registry.local/goodput-runtime:test"


def test_each_engine_image_is_a_flag_too():
    from goodput_operator.__main__ import parse_args

    args = parse_args(["--vllm-image", "v:2", "--vllm-cpu-image", "v:cpu2", "--sglang-image", "s:2"], Settings())
    assert (args.vllm_image, args.vllm_cpu_image, args.sglang_image) == ("v:2", "v:cpu2", "s:2")


def test_settings_read_each_engine_image_from_the_environment():
    settings = Settings.from_env({"VLLM_IMAGE": "v:1", "VLLM_CPU_IMAGE": "v:cpu", "SGLANG_IMAGE": "s:1"})
    assert (settings.vllm_image, settings.vllm_cpu_image, settings.sglang_image) == ("v:1", "v:cpu", "s:1")
    defaults = Settings.from_env({})
    for image in (defaults.vllm_image, defaults.vllm_cpu_image, defaults.sglang_image):
        assert ":" in image and not image.endswith(":latest")  # pinned by tag


@pytest.mark.parametrize("sample", ["chat.yaml", "chat-vllm.yaml", "chat-sglang.yaml"])
def test_each_sample_is_valid_for_its_engine(sample):
    import pathlib

    import yaml

    body = yaml.safe_load((pathlib.Path(__file__).resolve().parents[2] / "manifests" / "samples" / sample).read_text())
    parsed = svc(body["spec"])
    assert sample == "chat.yaml" or sample == f"chat-{parsed.engine.kind}.yaml"


def test_monitors_of_other_engines_name_the_model_and_tag_the_slo_buckets():
    from goodput_operator.builders import build_pod_monitor, build_service_monitor

    ours = build_service_monitor(svc(full("goodput")), OWNER)["spec"]["endpoints"][0]
    assert "metricRelabelings" not in ours  # our runtime counts good requests itself
    endpoint = build_pod_monitor(svc(full("vllm")), OWNER)["spec"]["podMetricsEndpoints"][0]
    relabel = endpoint["metricRelabelings"]
    assert relabel[0] == {
        "sourceLabels": ["model_name"],
        "regex": "(.+)",
        "targetLabel": "model",
        "replacement": "$1",
        "action": "replace",
    }
    tags = {r["replacement"]: r["regex"] for r in relabel[1:]}
    # the `le` the engine prints for each target (prometheus_client's formatting), escaped for the regex
    assert tags == {
        "ttft": r"vllm:time_to_first_token_seconds_bucket;0\.3",
        "tpot": r"vllm:request_time_per_output_token_seconds_bucket;0\.045",
    }
    sglang = build_service_monitor(svc(full("sglang")), OWNER)["spec"]["endpoints"][0]["metricRelabelings"]
    assert sglang[2]["regex"] == r"sglang:inter_token_latency_seconds_bucket;0\.045"
