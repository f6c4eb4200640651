"""A 30-second soak on the real model (bench/soak.py, shortened): mixed traffic leaves nothing behind."""

from __future__ import annotations

import argparse

import pytest

from bench import soak

pytestmark = pytest.mark.slow


def test_half_a_minute_of_streams_cancels_disconnects_bad_requests_and_n_leaks_nothing(smollm2_dir, tmp_path):
    args = soak.build_parser().parse_args(
        ["--model-dir", str(smollm2_dir), "--duration", "30", "--workers", "3", "--output", str(tmp_path / "soak.json")]
    )
    assert isinstance(args, argparse.Namespace)
    result = soak.run(args)
    print(soak.render(result))
    kinds = {key.split(":")[0] for key in result["outcomes"]}
    assert kinds == set(soak.KINDS), result["outcomes"]  # every kind of traffic was sent
    assert not [k for k in result["outcomes"] if k.split(":")[1] not in ("ok", "429")], result["outcomes"]
    after, before = result["state_after"], result["state_before"]
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
    assert after["requests_in_flight"] == 0 and after["engine_streams"] == 0
    assert after["asyncio_tasks"] <= before["asyncio_tasks"]
    assert after["open_files"] <= before["open_files"]
    assert result["health"] == 200
    assert result["rss_growth"] < 0.05, f"RSS grew {result['rss_growth']:.1%} after warm-up"
