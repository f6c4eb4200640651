"""A failing step fails its requests, not the server; a dead step loop shows in health.

Faults are injected into the real engine (a forward pass that raises once, as a device
error would), since a real device fault cannot be produced on demand here.
"""

from __future__ import annotations

import asyncio

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.async_engine import AsyncEngine
from goodput_runtime.sampling import SamplingParams


async def collect(stream) -> tuple[list[int], str | None]:
    tokens, reason = [], None
    async for out in stream:
        tokens += out.token_ids
        reason = out.finish_reason
    return tokens, reason


async def engine_failing_at(model_dir, call: int, before_raising=lambda engine: None) -> AsyncEngine:
    """A started engine whose forward pass raises on its `call`-th run (counted from after warm-up), as a
    device error would; `before_raising(engine)` runs inside that step first."""
    engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir), kv_cache_memory=1 << 20, max_model_len=256))
    await engine.start()
    real_run = engine.core.runner.run
    calls = {"n": 0}

    def run(out):
        calls["n"] += 1
        if calls["n"] == call:
            before_raising(engine)
            raise RuntimeError("injected device error")
        return real_run(out)

    engine.core.runner.run = run
    return engine


PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


async def test_a_step_that_raises_fails_its_requests_and_the_engine_keeps_serving(tiny_model_dir):
    engine = await engine_failing_at(tiny_model_dir, 3)
    try:
        failed = await asyncio.gather(
            *(collect(engine.add_request(f"a{i}", [5, 6, 7, i + 8], PARAMS)) for i in range(3))
        )
        assert {reason for _, reason in failed} == {"error"}
        assert engine.num_free_blocks == engine.num_total_blocks
        tokens, reason = await collect(engine.add_request("after", [5, 6, 7], PARAMS))
        assert reason == "length" and len(tokens) == 20
        assert engine.alive
    finally:
        await engine.shutdown()
    assert not engine.alive


async def test_an_abort_that_arrives_during_a_failing_step_does_not_outlive_it(tiny_model_dir):
    # the client goes away while the failing step runs: the abort waits for the step
    engine = await engine_failing_at(tiny_model_dir, 2, before_raising=lambda e: e.abort("x"))
    try:
        _, reason = await collect(engine.add_request("x", [5, 6, 7, 8], PARAMS))
        assert reason == "error"
        # the same id again (a retry): the stale abort must not end it
        tokens, reason = await collect(engine.add_request("x", [5, 6, 7, 8], PARAMS))
        assert reason == "length" and len(tokens) == 20
    finally:
        await engine.shutdown()
