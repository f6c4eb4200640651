"""Options the LoRA path does not serve are refused at start, by name, before any weight loads; the ones
it serves (speculative decoding with a draft model) keep each adapter's tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from lora_adapters import make_adapter, peft_greedy

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import EngineConfigError, build_core
from goodput_runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def qvd4(tiny_model_dir: Path) -> Path:
    return make_adapter(tiny_model_dir, "qvd4", 4, ["q_proj", "v_proj", "down_proj"], rslora=True, seed=1)


def engine_config(model_dir: Path, adapter: Path, **kw) -> EngineConfig:
    settings = dict(
        model=str(model_dir),
        dtype="float32",
        block_size=4,
        kv_cache_memory=1 << 20,
        max_model_len=128,
        max_num_seqs=4,
        lora_modules=(("qvd4", str(adapter)),),
        max_lora_rank=8,
    )
    settings.update(kw)
    return EngineConfig(**settings)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"compile": True}, "--lora-modules with --compile"),
        ({"tensor_parallel_size": 2}, "--lora-modules with --tensor-parallel-size 2"),
        ({"pipeline_parallel_size": 2}, "--lora-modules with --pipeline-parallel-size 2"),
        ({"model_impl": "transformers"}, "--lora-modules with --model-impl transformers"),
        ({"kv_transfer_role": "prefill"}, "--lora-modules with --kv-transfer-role prefill"),
        ({"kv_transfer_role": "decode"}, "--lora-modules with --kv-transfer-role decode"),
        ({"lora_modules": (), "lora_source": "s3://bucket/adapters"}, "--lora-source s3://bucket/adapters"),
        ({"lora_modules": (), "lora_source": "hf://org/repo"}, "expected hf://ORG"),
    ],
)
def test_an_option_the_lora_path_does_not_serve_is_refused_by_name(tiny_model_dir, qvd4, options, named):
    with pytest.raises(EngineConfigError, match=named):
        build_core(engine_config(tiny_model_dir, qvd4, **options))


def test_the_runtime_process_stops_at_start_naming_the_option(tiny_model_dir, qvd4, tmp_path):
    args = ["--model", str(tiny_model_dir), "--device", "cpu", "--lora-modules", f"qvd4={qvd4}"]
    args += ["--pipeline-parallel-size", "2", "--termination-message-path", str(tmp_path / "termination")]
    result = subprocess.run(
        [sys.executable, "-m", "goodput_runtime", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode != 0
    message = (tmp_path / "termination").read_text()
    assert "--pipeline-parallel-size 2" in message and "LoRA" in message, message


def test_speculative_decoding_with_a_draft_model_keeps_the_adapters_tokens(tiny_model_dir, qvd4):
    # the draft model proposes without the adapter; the target verifies on the adapter's rows
    prompt = list(range(20, 44))
    expected = peft_greedy(tiny_model_dir, qvd4, prompt, 10)
    core = build_core(
        engine_config(
            tiny_model_dir,
            qvd4,
            speculative_method="draft",
            speculative_model=str(tiny_model_dir),
            num_speculative_tokens=3,
            speculative_max_batch=4,
        )
    )
    core.add("a", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, lora="qvd4"))
    core.add("b", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    produced: dict[str, list[int]] = {"a": [], "b": []}
    while core.has_unfinished():
        for output in core.step():
            produced[output.request_id].extend(output.token_ids)
    assert produced["a"] == expected
    assert produced["b"] == peft_greedy(tiny_model_dir, None, prompt, 10)
    assert produced["a"] != produced["b"]
