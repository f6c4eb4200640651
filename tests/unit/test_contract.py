"""The contract between operator and runtime: the operator admits exactly what the runtime starts.

For a table of published model configs × tensor-parallel sizes × quantization methods × devices,
the operator's checks (the capacity functions its reconcile calls) and the runtime's own start-up
checks (architecture, quantization on the device it finds, tensor-parallel split) run on the same
inputs and must agree; the command line the operator derives must parse in the runtime's parser.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig

from goodput_contract import flags, parallel, quantization
from goodput_contract import metrics as metric_names
from goodput_contract.api.spec import parse
from goodput_operator import capacity
from goodput_operator.builders import runtime_args
from goodput_runtime.__main__ import build_parser, engine_config, parse_args
from goodput_runtime.engine.parallel import TensorParallelError, validate
from goodput_runtime.engine.rank_model import pick_device
from goodput_runtime.layers.quantization import QuantizationError, check_method
from goodput_runtime.loader import ModelLoadError, check_architecture
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.request_times import RequestTimes

ROOT = Path(__file__).resolve().parents[2]


def config(
    architecture: str,
    model_type: str,
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    **extra,
) -> dict:
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
        **extra,
    }


# the fields of each published config.json that tensor parallelism and sizing read
MODELS = {
    "Llama-3-8B": config(
        "LlamaForCausalLM", "llama", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256
    ),
    "Qwen2.5-0.5B": config(
        "Qwen2ForCausalLM",
        "qwen2",
        hidden=896,
        layers=24,
        heads=14,
        kv_heads=2,
        intermediate=4864,
        vocab=151936,
        tie_word_embeddings=True,
    ),
    "Mistral-7B-v0.1": config(
        "MistralForCausalLM",
        "mistral",
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        intermediate=14336,
        vocab=32000,
        sliding_window=4096,
    ),
    "SmolLM2-135M": config(
        "LlamaForCausalLM",
        "llama",
        hidden=576,
        layers=30,
        heads=9,
        kv_heads=3,
        intermediate=1536,
        vocab=49152,
        tie_word_embeddings=True,
    ),
    "Gemma-2-2B": config(
        "Gemma2ForCausalLM",
        "gemma2",
        hidden=2304,
        layers=26,
        heads=8,
        kv_heads=4,
        intermediate=9216,
        vocab=256000,
        head_dim=256,
    ),
}
TENSORS = (1, 2, 3, 4, 8, 16)
# None: no GPU; else a GPU product the operator knows the compute capability of
DEVICES = (None, "NVIDIA-H100-80GB-HBM3", "NVIDIA-L4", "NVIDIA-A100-SXM4-80GB", "Tesla-T4")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    dirs = {}
    for name, raw in MODELS.items():
        path = tmp_path_factory.mktemp(name.lower().replace(".", "-"))
        (path / "config.json").write_text(json.dumps(raw))
        dirs[name] = path
    return dirs


def simulate_gpus(monkeypatch, product: str, count: int) -> None:
    """What the runtime sees in a pod of `count` GPUs of `product`, without a GPU."""
    major, minor = capacity.GPU_COMPUTE_CAPABILITY[product]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: product)
    monkeypatch.setattr(torch.version, "hip", None)


def operator_refusal(raw: dict, spec: dict) -> str | None:
    """What the operator's reconcile would report for this spec and config.json (None: admitted)."""
    svc = parse("svc", "ns", spec)
    model = capacity.ModelConfig.from_dict(raw)
    return (
        capacity.quantization_problem(svc.model.quantization, svc.resources)
        or capacity.architecture_problem(model)
        or capacity.tensor_parallel_problem(model, svc.tensor_parallel)
    )


def runtime_refusal(argv: list[str]) -> str | None:
    """The runtime's start-up checks on the command line the operator generated, in build_core's
    order, up to loading weights (None: it starts)."""
    config = engine_config(parse_args(argv))
    model_dir = Path(config.model)
    try:
        check_architecture(model_dir)
        device = pick_device(config.device)
        check_method(config.quantization, device)
        if config.tensor_parallel_size > 1:
            validate(AutoConfig.from_pretrained(model_dir), config.tensor_parallel_size, device)
    except (ModelLoadError, QuantizationError, TensorParallelError) as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: d or "cpu")
@pytest.mark.parametrize("method", quantization.METHODS)
@pytest.mark.parametrize("tensor", TENSORS)
@pytest.mark.parametrize("model", list(MODELS))
def test_the_operator_admits_exactly_what_the_runtime_starts(model_dirs, monkeypatch, model, tensor, method, device):
    gpus = 0 if device is None else tensor
    if device is not None:
        simulate_gpus(monkeypatch, device, gpus)
    spec = {
        "model": {"source": f"file://{model_dirs[model]}", "quantization": method},
        "parallelism": {"tensor": tensor},
        "resources": {"gpu": gpus, "gpuProduct": device},
    }
    argv = runtime_args(parse("svc", "ns", spec))
    args = build_parser().parse_args(argv)  # the runtime's parser takes what the operator generates
    assert (args.tensor_parallel_size, args.quantization, args.device) == (tensor, method, "cuda" if gpus else "cpu")

    refused_by_operator = operator_refusal(MODELS[model], spec)
    refused_by_runtime = runtime_refusal(argv)
    assert (refused_by_operator is None) == (refused_by_runtime is None), (refused_by_operator, refused_by_runtime)


def test_llama_3_8b_on_16_gpus_is_refused_by_both_naming_its_8_kv_heads(model_dirs, monkeypatch):
    # once admitted by the operator, then a crash loop in the runtime
    simulate_gpus(monkeypatch, "NVIDIA-H100-80GB-HBM3", 16)
    spec = {"model": {"source": f"file://{model_dirs['Llama-3-8B']}"}, "parallelism": {"tensor": 16}}
    operator_says = operator_refusal(MODELS["Llama-3-8B"], spec)
    runtime_says = runtime_refusal(runtime_args(parse("svc", "ns", spec)))
    assert operator_says is not None and "KV heads (8) is not divisible by parallelism.tensor 16" in operator_says
    assert runtime_says is not None and "KV heads (8) is not divisible by --tensor-parallel-size 16" in runtime_says
    assert "must be 1, 2, 4 or 8" in operator_says and "must be 1, 2, 4 or 8" in runtime_says


@pytest.mark.parametrize(
    ("model", "sizes"),
    [
        ("Llama-3-8B", [1, 2, 4, 8]),
        ("Qwen2.5-0.5B", [1, 2]),
        ("Mistral-7B-v0.1", [1, 2, 4, 8]),
        ("SmolLM2-135M", [1, 3]),
    ],
)
def test_the_sizes_a_refusal_suggests_are_exactly_the_ones_admitted(model, sizes):
    shape = capacity.ModelConfig.from_dict(MODELS[model]).shape
    assert parallel.valid_tensor_sizes(shape) == sizes
    admitted = [n for n in range(1, 33) if parallel.tensor_parallel_problem(shape, n, "parallelism.tensor") is None]
    assert admitted == sizes


def test_every_flag_the_contract_names_is_one_the_runtime_parses():
    parser = build_parser()
    known = {option for action in parser._actions for option in action.option_strings}
    named = {value for name, value in vars(flags).items() if name.isupper() and isinstance(value, str)}
    named |= {flags.negated(flag) for flag in flags.BOOLEAN_FLAGS}
    assert named - known == set()
    assert set(flags.CR_FIELD_FLAGS.values()) <= named


def test_every_cr_field_the_contract_maps_reaches_the_runtime_as_its_value():
    spec = {
        "model": {
            "source": "hf://org/model",
            "revision": "v2",
            "servedName": "chat",
            "dtype": "float16",
            "maxModelLen": 2048,
            "quantization": "int8",
        },
        "engine": {
            "maxNumSeqs": 7,
            "maxBatchedTokens": 512,
            "gpuMemoryUtilization": 0.8,
            "prefixCaching": False,
            "maxQueue": 9,
            "speculative": {"method": "draft", "tokens": 5, "draftModel": "hf://org/draft"},
        },
        "parallelism": {"tensor": 2},
        "resources": {"gpu": 2},
        "slo": {"ttft": "250ms", "tpot": "40ms"},
    }
    args = vars(build_parser().parse_args(runtime_args(parse("svc", "ns", spec))))
    expected = {
        "model.source": "org/model",
        "model.revision": "v2",
        "model.servedName": "chat",
        "model.dtype": "float16",
        "model.maxModelLen": 2048,
        "model.quantization": "int8",
        "engine.maxNumSeqs": 7,
        "engine.maxBatchedTokens": 512,
        "engine.gpuMemoryUtilization": 0.8,
        "engine.prefixCaching": False,
        "engine.maxQueue": 9,
        "parallelism.tensor": 2,
        "resources.gpu": "cuda",
        "slo.ttft": 0.25,
        "slo.tpot": 0.04,
        "engine.speculative.method": "draft",
        "engine.speculative.tokens": 5,
        "engine.speculative.draftModel": "org/draft",
    }
    assert set(expected) == set(flags.CR_FIELD_FLAGS)
    for field, flag in flags.CR_FIELD_FLAGS.items():
        dest = flag.removeprefix("--").replace("-", "_")
        assert args[dest] == expected[field], field


def test_quantization_methods_agree_across_crd_runtime_and_contract():
    parser = build_parser()
    choices = next(a.choices for a in parser._actions if flags.QUANTIZATION in a.option_strings)
    assert tuple(choices) == quantization.METHODS
    crd = yaml.safe_load((ROOT / "crds" / "serving.goodput.dev_inferenceservices.yaml").read_text())
    model = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]
    assert tuple(model["properties"]["quantization"]["enum"]) == quantization.METHODS


AUTOSCALER_PREFIX = metric_names.PREFIX + "autoscaler_"
GATEWAY_PREFIX = metric_names.PREFIX + "gateway_"
BATCH_PREFIX = metric_names.PREFIX + "batch_"  # the gateway's batch API
PIPELINE_PREFIXES = (metric_names.PREFIX + "pipeline_", metric_names.PREFIX + "guard_")  # the gateway's pipelines


def test_the_runtime_exports_every_series_the_contract_names(tmp_path):
    from goodput_runtime.engine.block_manager import BlockManager
    from goodput_runtime.engine.kv_events import KvEvents
    from goodput_runtime.engine.kv_offload import OffloadStore

    metrics = RuntimeMetrics("m", 0.5, 0.05)
    metrics.enable_lora(2)  # the LoRA adapters' series, registered where adapters are enabled
    blocks = BlockManager(4, 4)  # the KV tiers' series: with events, and with an offload tier configured
    blocks.events, blocks.offload = KvEvents(4), OffloadStore(str(tmp_path), 4096, 64)
    metrics.watch_kv_tiers(blocks)
    metrics.record_lora_load("ok", 0.1)
    metrics.record_finished(
        RequestTimes(arrival=0.0, first_scheduled=0.1, first_token=0.2, finished=1.0, num_output_tokens=3)
    )
    metrics.record_finished(
        RequestTimes(arrival=0.0, first_scheduled=0.1, first_token=0.2, finished=0.25, num_output_tokens=3, lora="a")
    )
    assert metrics.lora is not None
    with metrics.lora.record_loading("b"):  # shown only while a load of a name not yet served runs
        exported = {sample.name for family in metrics.registry.collect() for sample in family.samples}
    runtime_series = {
        value
        for name, value in vars(metric_names).items()
        if name.isupper()
        and isinstance(value, str)
        and value.startswith(metric_names.PREFIX)
        and value != metric_names.PREFIX
        and not value.startswith((AUTOSCALER_PREFIX, GATEWAY_PREFIX, BATCH_PREFIX, *PIPELINE_PREFIXES))
    }
    histograms = {
        metric_names.TTFT,
        metric_names.TPOT,
        metric_names.E2E_LATENCY,
        metric_names.QUEUE_TIME,
        metric_names.GRAMMAR_COMPILE_TIME,
        metric_names.LORA_LOAD_SECONDS,
    }
    blocks.offload.close()
    for name in runtime_series:
        assert (name + "_count" if name in histograms else name) in exported, name


def test_the_gateway_exports_every_gateway_series_the_contract_names():
    from goodput_gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.service_seen("ns", "chat")
    metrics.requests.labels("ns", "chat", "200").inc()
    metrics.duration.labels("ns", "chat").observe(0.1)
    metrics.hold.labels("ns", "chat").observe(1.0)
    metrics.last_request.labels("ns", "chat").set(1.0)
    exported = {sample.name for family in metrics.registry.collect() for sample in family.samples}
    gateway_series = {
        value
        for name, value in vars(metric_names).items()
        if name.isupper() and isinstance(value, str) and value.startswith(GATEWAY_PREFIX)
    }
    assert len(gateway_series) == 9
    histograms = {metric_names.GATEWAY_REQUEST_DURATION, metric_names.GATEWAY_HOLD_DURATION}
    for name in gateway_series:
        assert (name + "_count" if name in histograms else name) in exported, name


def test_the_operator_exports_every_autoscaler_series_the_contract_names():
    from prometheus_client import REGISTRY

    import goodput_operator.metrics  # noqa: F401  (registers the operator's series)

    exported = {family.name for family in REGISTRY.collect()}
    exported |= {name + "_total" for name in exported}  # counters' families drop the suffix
    autoscaler_series = {
        value
        for name, value in vars(metric_names).items()
        if name.isupper() and isinstance(value, str) and value.startswith(AUTOSCALER_PREFIX)
    }
    assert len(autoscaler_series) >= 7
    for name in autoscaler_series:
        assert name in exported, name


def test_the_contract_imports_only_the_standard_library():
    script = (
        "import sys, pkgutil, importlib, goodput_contract\n"
        "for m in pkgutil.iter_modules(goodput_contract.__path__):\n"
        "    importlib.import_module('goodput_contract.' + m.name)\n"
        "others = {n.split('.')[0] for n in sys.modules} - set(sys.stdlib_module_names)\n"
        "print(sorted(others - {'goodput_contract', '__main__'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT / "contract")},
    )
    assert out.stdout.strip() == "[]"
