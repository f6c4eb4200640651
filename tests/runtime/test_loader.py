"""Model loading: Hugging Face ids through the standard cache, local paths, clear refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import EngineConfigError, build_core
from goodput_runtime.loader import ModelLoadError, resolve_model_path


def test_a_hugging_face_id_resolves_through_the_standard_cache(tiny_model_dir, tmp_path):
    # the hub's cache layout, filled from the local model: no network is touched (offline mode)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--goodput-test--tiny-llama"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    script = textwrap.dedent("""
        from goodput_runtime.config import EngineConfig
        from goodput_runtime.engine.builder import build_core
        from goodput_runtime.sampling import SamplingParams
        for name in ("goodput-test/tiny-llama", "hf://goodput-test/tiny-llama"):
            core = build_core(EngineConfig(model=name, kv_cache_memory=1 << 20, max_model_len=64))
            core.add("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            tokens = []
            while core.has_unfinished():
                for out in core.step():
                    tokens += out.token_ids
            print(name, len(tokens))
    """)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["goodput-test/tiny-llama 3", "hf://goodput-test/tiny-llama 3"]


def test_an_unknown_hugging_face_id_fails_with_the_id_in_the_message(tmp_path, monkeypatch):
    script = "from goodput_runtime.loader import resolve_model_path; resolve_model_path('nobody/nothing', 'v1')"
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "cannot fetch model 'nobody/nothing' (revision v1)" in done.stderr


def test_file_urls_and_plain_paths_are_local(tiny_model_dir):
    assert resolve_model_path(f"file://{tiny_model_dir}") == tiny_model_dir
    assert resolve_model_path(str(tiny_model_dir)) == tiny_model_dir


def test_a_missing_local_directory_is_named():
    with pytest.raises(ModelLoadError, match="/no/such/model does not exist"):
        resolve_model_path("/no/such/model")


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        build_core(EngineConfig(model=str(model_dir), kv_cache_memory=1 << 20))
    message = str(err.value)
    assert "unsupported architecture GPT2LMHeadModel" in message
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in message


def test_a_kv_cache_too_small_for_one_full_sequence_is_refused(tiny_model_dir):
    with pytest.raises(EngineConfigError, match="fewer than --max-model-len 4096"):
        build_core(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=64 << 10, max_model_len=4096))


def test_a_max_model_len_beyond_the_model_is_refused(tiny_model_dir):
    with pytest.raises(EngineConfigError, match="exceeds the model's limit of 4096"):
        build_core(EngineConfig(model=str(tiny_model_dir), max_model_len=10_000))
