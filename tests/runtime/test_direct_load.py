"""Loading straight into the compact modules (models/direct.py): the served model holds exactly the weights,
biases, tied head, dtype and rotary embedding transformers' loading gives, a server starts without importing
transformers' model code or torch's compiler, and what the direct path cannot load goes through transformers."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_greedy import reference, run_all, small_config, workload
from test_models import mistral_dir
from transformers import AutoConfig

from goodput_runtime.engine.builder import build_core
from goodput_runtime.layers import attention
from goodput_runtime.loader import load_config, load_model
from goodput_runtime.models import direct
from goodput_runtime.models.llama import CausalLM, from_transformers


def through_transformers(model_dir: Path, dtype: torch.dtype) -> CausalLM:
    return from_transformers(load_model(model_dir, dtype, torch.device("cpu"), attention.register()))


def assert_same_model(ours: CausalLM, theirs: CausalLM) -> None:
    mine, other = ours.state_dict(), theirs.state_dict()
    assert list(mine) == list(other)
    for name, tensor in other.items():
        assert mine[name].dtype == tensor.dtype, name
        assert torch.equal(mine[name], tensor), name
    positions = torch.arange(300)[None]
    x = torch.zeros(1, dtype=next(iter(other.values())).dtype)
    for got, want in zip(ours.model.rotary_emb(x, positions), theirs.model.rotary_emb(x, positions), strict=True):
        assert torch.equal(got, want)
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [
        layer.self_attn.sliding_window for layer in theirs.model.layers
    ]
    assert ours.generation_config.to_diff_dict() == theirs.generation_config.to_diff_dict()
    tied = ours.lm_head.weight is ours.model.embed_tokens.weight
    assert tied == (theirs.lm_head.weight is theirs.model.embed_tokens.weight)


def without_weights(model_dir: Path, out: Path) -> Path:
    """A copy of the model directory's config and tokenizer files, its weights left for the test to write."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def tied_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny Llama with its LM head tied to the embeddings and stored in two shards with an index."""
    out = without_weights(tiny_model_dir, tmp_path / "tied")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tensors = {k: v for k, v in load_file(tiny_model_dir / "model.safetensors").items() if k != "lm_head.weight"}
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in halves.items():
        save_file({k: tensors[k] for k in part}, out / shard)
    index = {"metadata": {}, "weight_map": {k: shard for shard, part in halves.items() for k in part}}
    (out / direct.INDEX).write_text(json.dumps(index))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "tied-sharded"])
def test_the_direct_model_is_the_one_transformers_loads(arch, dtype, tiny_model_dir, tiny_qwen2_dir, tmp_path):
    model_dir = {
        "llama": lambda: tiny_model_dir,
        "qwen2": lambda: tiny_qwen2_dir,
        "mistral": lambda: mistral_dir(tiny_model_dir, tmp_path),
        "tied-sharded": lambda: tied_dir(tiny_model_dir, tmp_path),
    }[arch]()
    config = load_config(model_dir)
    assert direct.reason(model_dir, config, "auto", 1) is None
    ours = direct.load(model_dir, config, dtype, torch.device("cpu"))
    assert ours is not None
    assert_same_model(ours, through_transformers(model_dir, dtype))
    if arch == "qwen2":  # biased q, k and v: the fused projection carries them
        assert ours.model.layers[0].self_attn.qkv_proj.bias is not None


def test_a_tied_sharded_checkpoint_serves_transformers_greedy_tokens(tiny_model_dir, tmp_path):
    model_dir = tied_dir(tiny_model_dir, tmp_path)
    cases = workload(seed=5, n=6)
    core = build_core(small_config(model_dir, blocks=200))
    assert isinstance(core.runner.model, CausalLM)
    assert run_all(core, cases) == reference(model_dir, cases)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    ],
    ids=lambda r: r["rope_type"],
)
def test_scaled_rotary_embeddings_equal_transformers(rope, tiny_model_dir):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = AutoConfig.from_pretrained(tiny_model_dir, rope_parameters={"rope_theta": 500000.0, **rope})
    assert direct.reason(tiny_model_dir, config, "auto", 1) is None
    ours, theirs = direct.RotaryEmbedding(config, torch.device("cpu")), LlamaRotaryEmbedding(config)
    positions = torch.arange(0, 8192, 7)[None]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, dtype=dtype)
        for got, want in zip(ours(x, positions), theirs(x, positions), strict=True):
            assert torch.equal(got, want)


def test_what_the_direct_path_cannot_load_names_its_reason(tiny_model_dir, smollm2_gguf):
    config = load_config(tiny_model_dir)
    assert direct.reason(tiny_model_dir, config, "transformers", 1) == "--model-impl transformers"
    assert direct.reason(tiny_model_dir, config, "auto", 2) == "more than one rank"
    assert direct.reason(smollm2_gguf, load_config(smollm2_gguf), "auto", 1) == "not a directory of safetensors"
    dynamic = AutoConfig.from_pretrained(tiny_model_dir, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    assert direct.reason(tiny_model_dir, dynamic, "auto", 1) == "rotary scaling 'dynamic'"
    quantized = AutoConfig.from_pretrained(tiny_model_dir)
    quantized.quantization_config = {"quant_method": "gptq"}
    assert direct.reason(tiny_model_dir, quantized, "auto", 1) == "a quantized checkpoint"


def test_a_checkpoint_missing_a_tensor_loads_through_transformers(tiny_model_dir, tmp_path, caplog):
    """A tensor missing (transformers initialises it, and warns): the direct path declines, and transformers'
    loading serves the tokens transformers gives."""
    model_dir = without_weights(tiny_model_dir, tmp_path / "missing")
    tensors = load_file(tiny_model_dir / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    assert direct.load(model_dir, load_config(model_dir), torch.float32, torch.device("cpu")) is None
    with caplog.at_level(logging.INFO, logger="goodput_runtime.engine.rank_model"):
        core = build_core(small_config(model_dir, blocks=200))
    assert "Loading through transformers' model code: a tensor missing" in caplog.text
    cases = workload(seed=7, n=4)
    assert run_all(core, cases) == reference(model_dir, cases)


def test_a_server_starts_without_transformers_model_code_or_torchs_compiler(tiny_model_dir):
    """What makes the start seconds shorter: building the engine imports neither."""
    code = (
        "import sys\n"
        "from goodput_runtime.engine.builder import build_core\n"
        "from test_engine_greedy import small_config\n"
        f"core = build_core(small_config({str(tiny_model_dir)!r}))\n"
        "print(sorted(m for m in ('transformers.modeling_utils', 'torch._dynamo') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).parent,
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"
