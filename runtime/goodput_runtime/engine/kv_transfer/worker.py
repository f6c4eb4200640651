"""The worker side: a hand-off's blocks read out of the KV cache and written into it, by block id.

Both run on the engine's step thread (between forward passes), so a block is never read while a step
writes it. A block's bytes are every layer's keys, then every layer's values, of its tokens (the
offload tier's payload, ``ModelRunner.block_payload_shape``). On a GPU the bytes are staged through
pinned host memory: one gather per layer into a device buffer, one copy to a pinned buffer out; one
copy from a pinned buffer and one scatter per layer in.
"""

from __future__ import annotations

import torch

from goodput_runtime.engine.model_runner import ModelRunner


def block_bytes(runner: ModelRunner) -> int:
    shape = runner.block_payload_shape()
    return int(torch.Size(shape).numel()) * torch.tensor([], dtype=runner.dtype).element_size()


@torch.inference_mode()
def read_blocks(runner: ModelRunner, block_ids: list[int]) -> memoryview:
    """The blocks' bytes, concatenated in the order given."""
    shape = runner.block_payload_shape()
    ids = torch.tensor(block_ids, device=runner.device, dtype=torch.long)
    rows = torch.empty((len(block_ids), *shape), dtype=runner.dtype, device=runner.device)
    for i, cache in enumerate(runner._by_block()):
        rows[:, i] = cache.index_select(0, ids)
    if runner.device.type == "cuda":
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows)  # synchronous: the bytes are final when this returns
        rows = host
    return rows.view(torch.uint8).reshape(-1).numpy().data


@torch.inference_mode()
def write_blocks(runner: ModelRunner, block_ids: list[int], data: bytearray) -> None:
    """Copy `data` (the blocks' bytes, concatenated in the order of block_ids) into those blocks."""
    if not block_ids:
        return
    shape = runner.block_payload_shape()
    rows = torch.frombuffer(data, dtype=runner.dtype).view(len(block_ids), *shape)
    if runner.device.type == "cuda":
        rows = rows.pin_memory().to(runner.device, non_blocking=True)
    ids = torch.tensor(block_ids, device=runner.device, dtype=torch.long)
    for i, cache in enumerate(runner._by_block()):
        cache.index_copy_(0, ids, rows[:, i])
    if runner.device.type == "cuda":
        torch.cuda.current_stream(runner.device).synchronize()
