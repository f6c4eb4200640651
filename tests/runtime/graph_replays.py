"""A step captured in a CUDA graph and replayed: what the `gpu` tests of dependent launches compare."""

from __future__ import annotations

from collections.abc import Callable

import torch


def replayed(step: Callable[[], torch.Tensor], times: int = 50) -> torch.Tensor:
    """`step` run once (compiling its kernels), captured in a CUDA graph, replayed `times` times: each
    replay's output, concatenated along the first dimension."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    replays = []
    for _ in range(times):
        graph.replay()
        replays.append(out.clone())
    return torch.cat(replays)
