"""Decode and prefill attention on CPU read straight from the paged KV cache: C++ kernels built on first use.

``attention.attend_decode`` otherwise copies every sequence's context out of the cache (one
``index_select`` of block rows for keys and one for values, per layer and step) and hands the
padded copies to ``scaled_dot_product_attention`` with a mask. The kernel here walks each
sequence's block table instead: per (sequence, kv head) it scores the block's keys for every
query head of the group, folds them into a running softmax (online, block by block) and adds
the block's values, all in fp32 (bfloat16 caches are widened on load; where the CPU has AVX-512
BF16, a bfloat16 key's scores are its pairwise bf16 products summed in fp32 instead, and a block's
values are widened once for the whole query group: 7-14 % less time for 16-64 sequences of 256
tokens than widening each key for each head; the bfloat16 loop takes two passes, every score first:
native_decode_loops_source.py). A CPU with AVX2 and no AVX-512 takes the same fold eight lanes wide
(2.4-2.7x faster than the scalar fold for 16-64 sequences, 1.18-1.36x whole decode steps of
SmolLM2-135M: bench/README.md); ``GOODPUT_DECODE_FOLD=avx2`` or ``scalar`` asks for a narrower fold.

A prompt chunk is otherwise attended by ``scaled_dot_product_attention`` (after a gather of its
context when it follows cached tokens): about 70 GFLOP/s for a 300-token prompt here. ``prefill``
packs each kv head's context once per layer (keys sixteen at a time side by side, values as
rows), then scores tiles of sixteen query rows (positions times the heads of the group) against
sixteen keys at a time, the rows' running maxima, corrections and sums kept as vectors, causal
and windowed masks only on the blocks that need them (AVX-512 only; elsewhere it returns None). It
takes bfloat16 (packed as fp32), but ``attention.attend`` gives bfloat16 chunks to torch's SDPA, whose
bf16 products run on AMX / AVX-512 BF16 (see attention.PREFILL_KERNEL).

The same extension holds the fused element-wise functions (native_ops_source.py, layers/fused.py) and
the skinny float32 product of the step plan's native form (native_linear_source.py, ``skinny_linear``).

The source is compiled with ``torch.utils.cpp_extension.load_inline`` the first time
either is called, under a name keyed by the source, the flags, torch's version and the
CPU's feature flags (so a changed source, or a cache directory moved to another CPU, builds
afresh). Where no compiler is present (the runtime image has none) or the build fails, that is
logged once and both return None: callers then take the torch path.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

from goodput_runtime.layers.native_attention_source import CPP_DECL, SOURCE
from goodput_runtime.layers.native_linear_source import LINEAR_DECL, LINEAR_FUNCTIONS, LINEAR_SOURCE
from goodput_runtime.layers.native_ops_source import OPS_DECL, OPS_FUNCTIONS, OPS_SOURCE
from goodput_runtime.layers.native_prefill_source import PREFILL_DECL, PREFILL_SOURCE

log = logging.getLogger(__name__)

# no contraction of products and sums into FMAs beyond the kernels' own: the fused element-wise
# operations round as torch's do
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]
DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "module": the built extension or None once a build has failed


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build_name() -> str:
    """The extension's name: a digest of everything its binary depends on."""
    key = "\n".join(
        [
            SOURCE,
            CPP_DECL,
            PREFILL_SOURCE,
            PREFILL_DECL,
            OPS_SOURCE,
            OPS_DECL,
            LINEAR_SOURCE,
            LINEAR_DECL,
            " ".join(CFLAGS + LDFLAGS),
            torch.__version__,
            platform.machine(),
            _cpu_flags(),
        ]
    )
    return "goodput_attention_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def build_directory(name: str) -> Path:
    """Where the extension is built: torch's own extensions cache (TORCH_EXTENSIONS_DIR, else
    ~/.cache/torch_extensions), one folder per build name."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(root) / name


def _build() -> Any:
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        log.info("native decode attention unavailable: no C++ compiler; decode attention stays on torch")
        return None
    from torch.utils.cpp_extension import load_inline

    started = time.monotonic()
    name = build_name()
    try:
        folder = build_directory(name)
        folder.mkdir(parents=True, exist_ok=True)
        # torch's own lock is a file that only its creator removes: a process killed while building (or
        # checking a build) leaves it, and every later load waits for it forever. An flock is let go
        # with its process; held, any torch lock file in the folder is one such leftover.
        with (folder / "goodput.flock").open("w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)
            module = load_inline(
                name=name,
                cpp_sources=[
                    CPP_DECL,
                    PREFILL_DECL,
                    OPS_DECL,
                    LINEAR_DECL,
                    SOURCE,
                    PREFILL_SOURCE,
                    OPS_SOURCE,
                    LINEAR_SOURCE,
                ],
                functions=["decode", "prefill", *OPS_FUNCTIONS, *LINEAR_FUNCTIONS],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(folder),
                verbose=False,
            )
    except Exception as exc:  # a missing toolchain piece, a read-only cache, a failed build: the torch path serves
        last = (str(exc).strip().splitlines() or [""])[-1]
        log.warning(
            "native decode attention unavailable (%s: %s); decode attention stays on torch", type(exc).__name__, last
        )
        return None
    log.info("native decode attention ready in %.1f s", time.monotonic() - started)
    return module


def module() -> Any:
    """The built extension, building it on the first call; None where it cannot be built."""
    if "module" not in _state:
        with _lock:
            if "module" not in _state:
                _state["module"] = _build()
    return _state["module"]


def available() -> bool:
    return module() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors (the build aside)."""
    return (
        query.device.type == "cpu"
        and query.dtype in DTYPES
        and k_cache.dtype == query.dtype
        and query.dim() == 3
        and query.shape[1] % k_cache.shape[1] == 0
    )


def decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scale: float | None,
    window: int | None,
) -> torch.Tensor | None:
    """query [B, H, D] attended over each row's paged context -> [B, H, D]; None where the kernel is
    unavailable or does not take these tensors (the caller then runs the torch path).

    k_cache, v_cache [slots, KVH, D] (slot = block * block_size + offset); blocks [B, n] int64, each
    row's context blocks in order; lens [B] the context lengths (the new token included); scale
    None: 1/sqrt(D); window: key j visible when len - window <= j < len."""
    ext = module() if supports(query, k_cache) else None
    if ext is None:
        return None
    blocks, lens = _int64_rows(blocks), _int64_rows(lens)
    return ext.decode(
        *_common(query, k_cache, v_cache), blocks, lens, block_size, _scale(query, scale), _window(window)
    )


def _common(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors every kernel reads as it expects them: the query's last dimension and the caches dense."""
    return (query if query.stride(-1) == 1 else query.contiguous()), k_cache.contiguous(), v_cache.contiguous()


def _int64_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def _scale(query: torch.Tensor, scale: float | None) -> float:
    return float(query.shape[-1] ** -0.5 if scale is None else scale)


def _window(window: int | None) -> int:
    return -1 if window is None else int(window)


def prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    start: int,
    scale: float | None,
    window: int | None,
) -> torch.Tensor | None:
    """query [n, H, D] of a prompt chunk whose first position is ``start``, attended causally over
    its context (the chunk's own keys and values already in the cache) -> [n, H, D]; None where the
    kernel is unavailable or does not take these tensors (it needs AVX-512 and D a multiple of 16
    up to 128).

    slots [start + n]: the cache slot of every context position; window: position p sees key j
    when p - window < j <= p."""
    ext = module() if supports(query, k_cache) else None
    if ext is None:
        return None
    return ext.prefill(
        *_common(query, k_cache, v_cache), _int64_rows(slots), int(start), _scale(query, scale), _window(window)
    )


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [T, in] @ weight [out, in]^T (+ bias) by the skinny product of native_linear_source.py, for float32
    on a CPU with AVX2 and FMA; None where it does not run (the caller then takes F.linear)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        return None
    ext = module()
    if ext is None or not weight.is_contiguous() or (bias is not None and bias.dtype != torch.float32):
        return None
    out: torch.Tensor | None = ext.skinny_linear(x if x.stride(-1) == 1 else x.contiguous(), weight, bias)
    return out


def skinny_linear_available() -> bool:
    """Whether this CPU's build has the skinny product (the step plan's native form)."""
    return skinny_linear(torch.ones(1, 8), torch.ones(1, 8), None) is not None
