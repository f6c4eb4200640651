"""GGUF files as model sources: the forms --model takes, the real file's header, clear refusals."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import gguf as gguf_py
import numpy as np
import pytest

from goodput_contract import gguf
from goodput_operator.capacity import ModelConfig, kv_bytes_per_token, parameter_count
from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.loader import ModelLoadError, check_architecture, dequantizable_types, resolve_model_path


def test_the_real_files_header_gives_smollm2s_shape(smollm2_gguf, smollm2_dir):
    header = gguf.read_header(smollm2_gguf)
    assert header.tensor_types() == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    config = ModelConfig.from_dict(gguf.hf_config(header))
    assert config.architectures == ("LlamaForCausalLM",)
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        576,
        30,
        9,
        3,
        64,
    )
    assert (config.intermediate_size, config.vocab_size, config.max_position_embeddings) == (1536, 49152, 8192)
    # the operator sizes it exactly as from the config.json transformers writes for it
    import json

    from_json = ModelConfig.from_dict(json.loads((smollm2_dir / "config.json").read_text()))
    assert parameter_count(config) == parameter_count(from_json) == 134_515_008
    assert kv_bytes_per_token(config, "float32") == kv_bytes_per_token(from_json, "float32") == 2 * 30 * 3 * 64 * 4


def test_a_gguf_file_or_a_directory_holding_one_is_a_model(smollm2_gguf, tmp_path):
    assert resolve_model_path(str(smollm2_gguf)) == smollm2_gguf
    assert resolve_model_path(f"file://{smollm2_gguf}") == smollm2_gguf
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / smollm2_gguf.name).symlink_to(smollm2_gguf)
    assert check_architecture(resolve_model_path(str(folder)))["architectures"] == ["LlamaForCausalLM"]
    assert check_architecture(smollm2_gguf)["num_hidden_layers"] == 30


def test_a_directory_holding_two_gguf_files_is_refused_naming_them(smollm2_gguf, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).symlink_to(smollm2_gguf)
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\); give the one to serve"):
        build_core(EngineConfig(model=str(tmp_path), kv_cache_memory=1 << 20))


def test_a_file_that_is_not_gguf_and_a_missing_gguf_file_are_named(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="is a file but not a GGUF file"):
        resolve_model_path(str(weights))
    with pytest.raises(ModelLoadError, match=r"model file /no/such/model\.gguf does not exist"):
        resolve_model_path("/no/such/model.gguf")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, not GGUF")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        build_core(EngineConfig(model=str(fake), kv_cache_memory=1 << 20))


def test_an_unsupported_quantization_type_is_refused_by_name(tmp_path):
    path = tmp_path / "q8_1.gguf"
    writer = gguf_py.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    block, size = gguf_py.GGML_QUANT_SIZES[gguf_py.GGMLQuantizationType.Q8_1]
    writer.add_tensor(
        "blk.0.ffn_up.weight",
        np.zeros((8, 64 // block * size), dtype=np.uint8),
        raw_dtype=gguf_py.GGMLQuantizationType.Q8_1,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as err:
        build_core(EngineConfig(model=str(path), kv_cache_memory=1 << 20))
    message = str(err.value)
    assert "unsupported GGUF quantization type Q8_1 (1 tensors, e.g. blk.0.ffn_up.weight)" in message
    assert "supported: " in message and "Q4_1" in message and "Q4_K" in message


def test_the_supported_types_are_those_the_gguf_package_dequantizes():
    supported = dequantizable_types()
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"} <= set(supported)
    assert "Q8_1" not in supported and "Q8_K" not in supported  # llama.cpp's intermediate formats


def test_one_gguf_file_of_a_hub_repository_resolves_through_the_standard_cache(smollm2_gguf, tmp_path):
    # the hub's cache layout holding just that file: no network is touched (offline mode)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--goodput-test--smollm2-gguf"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / smollm2_gguf.name).symlink_to(smollm2_gguf)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    script = textwrap.dedent(f"""
        from goodput_runtime.loader import check_architecture, resolve_model_path
        path = resolve_model_path("hf://goodput-test/smollm2-gguf/{smollm2_gguf.name}")
        print(path.name, check_architecture(path)["architectures"][0])
    """)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [smollm2_gguf.name, "LlamaForCausalLM"]
