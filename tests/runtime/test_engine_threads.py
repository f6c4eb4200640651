"""The engine's CPU forward passes use the threads it was given (--num-threads), not torch's default."""

import torch

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core


def test_the_engine_runs_with_the_threads_it_was_given(tiny_model_dir):
    before = torch.get_num_threads()
    try:
        build_core(
            EngineConfig(
                model=str(tiny_model_dir), device="cpu", kv_cache_memory=1 << 20, max_model_len=128, num_threads=1
            )
        )
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
