"""The hand-off's worker side (engine/kv_transfer/worker.py) on a real model runner: blocks written by id
from bytes read back byte for byte, in the order given, and other blocks untouched; the bytes of a block
are what the tcp transport moves (2 × layers × block size × KV heads × head size × element size). On a
CUDA GPU (the test marked `gpu`) the same through pinned host memory; elsewhere that one is skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.engine.kv_transfer import worker

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # the tiny model: keys and values, 2 layers, 2 KV heads of 16, fp32


def round_trip(model_dir: Path, device: str) -> None:
    config = EngineConfig(
        model=str(model_dir),
        device=device,
        dtype="float32",
        block_size=16,
        max_model_len=256,
        kv_cache_memory=64 * 16 * BYTES_PER_TOKEN,
        step_tuning="off",
        cpu_contention="off",
    )
    runner = build_core(config).runner
    size = worker.block_bytes(runner)
    assert size == 16 * BYTES_PER_TOKEN
    ids = [9, 3, 40]
    data = bytearray(torch.randn(len(ids) * size // 4, generator=torch.Generator().manual_seed(1)).numpy().tobytes())
    before = bytes(worker.read_blocks(runner, [5]))
    worker.write_blocks(runner, ids, data)
    assert bytes(worker.read_blocks(runner, ids)) == bytes(data)
    assert bytes(worker.read_blocks(runner, [40, 9])) == bytes(data[2 * size :]) + bytes(data[:size])
    assert bytes(worker.read_blocks(runner, [5])) == before


def test_blocks_written_by_id_read_back_byte_for_byte(tiny_model_dir: Path):
    round_trip(tiny_model_dir, "cpu")


@pytest.mark.gpu
def test_blocks_round_trip_through_pinned_memory_on_a_gpu(tiny_model_dir: Path):
    round_trip(tiny_model_dir, "cuda")
