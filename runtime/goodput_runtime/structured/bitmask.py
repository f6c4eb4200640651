"""Token bitmasks: one int32 word per 32 tokens, a set bit allowing its token, filled by llguidance's matchers.

llguidance's own torch helpers (``llguidance.torch``) are not imported: that module compiles a masking kernel
with ``torch.compile`` when it is imported, which loads inductor and adds about a second to every server's
start. The masks are filled through the matchers' pointer calls, as those helpers do."""

from __future__ import annotations

import llguidance
import torch


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32, every token allowed, on the CPU (pinned where a GPU is)."""
    shape = (rows, (vocab_size + 31) // 32)
    try:
        return torch.full(shape, -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())
    except RuntimeError:  # pinning refused: pageable memory serves the same
        return torch.full(shape, -1, dtype=torch.int32)


def check(bitmask: torch.Tensor) -> None:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError(f"a bitmask is contiguous CPU int32, not {bitmask.dtype} on {bitmask.device}")


def fill_row(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """The matcher's allowed tokens into one row of the bitmask."""
    check(bitmask)
    words = bitmask[row]
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)


def fill_rows(executor: llguidance.LLExecutor, rows: list[tuple[llguidance.LLMatcher, int]], bitmask: torch.Tensor):
    """Each (matcher, row)'s allowed tokens into its row, in one call on llguidance's thread pool."""
    check(bitmask)
    executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
