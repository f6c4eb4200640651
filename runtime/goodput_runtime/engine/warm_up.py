"""Kernels and compiled layers made ready at start-up, so that no request waits for them."""

from __future__ import annotations

import logging
import time

from goodput_runtime.engine.model_runner import ModelRunner
from goodput_runtime.layers import triton_attention
from goodput_runtime.models.llama import COMPILED_MAX_TOKENS

log = logging.getLogger(__name__)


def warm_up_triton(runner: ModelRunner, model_config, world: int) -> None:
    """The CUDA decode attention kernels' variants compiled now (triton_attention.warm_up), for each
    window the model's layers use, so that the first steps mixing decodes and prompts wait for none."""
    started, layout = time.monotonic(), runner.layout
    heads = model_config.num_attention_heads // world
    for window in {None, getattr(model_config, "sliding_window", None)}:
        triton_attention.warm_up(
            heads, layout.kv_heads, layout.head_dim, runner.block_size, layout.dtype, runner.device, window
        )
    log.info("compiled the Triton decode attention kernels in %.1f s", time.monotonic() - started)


def compile_layers(runner: ModelRunner) -> None:
    """torch.compile the compact modules' stack of layers and compile it now, with a step of each
    size whose projections take another form under the step plan, so no request waits for it."""
    model = runner.model
    reason = (
        "the model runs on transformers' modules" if not hasattr(model, "compile_layers") else model.compile_layers()
    )
    if reason is not None:
        log.info("--compile left off: %s", reason)
        return
    started = time.monotonic()
    sizes = {1, 2}
    if runner.plan is not None:
        sizes |= {n for n in (*runner.plan.counts, runner.plan.limit + 1) if n <= COMPILED_MAX_TOKENS}
    runner.warm_up(sorted(sizes))
    log.info(
        "compiled the decoder layers in %.1f s (steps of up to %d tokens; larger ones run eagerly)",
        time.monotonic() - started,
        COMPILED_MAX_TOKENS,
    )
