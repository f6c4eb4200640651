"""`bench.gpu_decode` runs on a CPU as well (the GPU figures come from `hack/gpu-checks.sh`): its
table compares our decode step with transformers' static-cache reference on the same prompts,
and in float32 the two must decode the same greedy tokens, or the comparison means nothing."""

from __future__ import annotations

import json
from pathlib import Path

from bench import gpu_decode


def test_decode_bench_agrees_with_the_static_cache_reference(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "gpu_decode.json"
    gpu_decode.main(
        [
            *("--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32"),
            *("--batch-sizes", "1,3", "--steps", "12", "--rounds", "2", "--prompt-len", "20"),
            *("--prefill-len", "64", "--reference-compile", "none", "--out", str(out)),
        ]
    )
    report = json.loads(out.read_text())
    assert report["greedy_tokens_equal"]
    for row in report["rows"]:
        assert row["greedy_agreement_with_reference"] == 1.0, row
        assert row["reference_step_ms"] > 0 and row["ours_over_reference"] > 0
    assert report["prefill"]["tokens"] == 64
    assert {"ours", "reference"} <= set(report["prefill"])
    table = capsys.readouterr().out
    assert "ours / reference" in table and "prefill of 64 tokens" in table


def test_agreement_counts_tokens_before_the_first_difference() -> None:
    assert gpu_decode.agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    assert gpu_decode.agreement([[1, 2], [5]], [[1, 2, 3], [6]]) == 0.5
