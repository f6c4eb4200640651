"""Whether this CPU computes bfloat16 natively, and what ``--dtype bfloat16`` runs in where it does not.

bfloat16 on a CPU pays where the hardware multiplies it: AVX-512 BF16 (``avx512_bf16``: Cooper Lake,
Sapphire Rapids and later Xeons, AMD Zen 4 and later) or AMX (``amx_bf16``: Sapphire Rapids and later).
There oneDNN, which runs torch's bfloat16 matrix products on a CPU, takes its AMX or AVX-512 BF16
kernels, the native attention kernels read a KV cache of half the bytes, and the fused element-wise
functions widen each value to fp32 as they load it. Without either flag oneDNN emulates bfloat16
products with fp32 instructions (AVX-512) or falls back to its reference code (AVX2 and older),
slower than float32 while rounding like bfloat16. On Arm the ``bf16`` feature (Armv8.6) is the
counterpart; it is accepted, not measured here.

The choice where the flags are missing is float32 with a warning, not a refusal: an InferenceService's
``dtype`` is one setting for every node its pods may land on, and a pod that refused to start on an
older node would restart forever, where float32 serves the same model, at about twice the weight
memory and with the KV cache's budget holding half the tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# any one of these: the CPU multiplies bfloat16 itself (x86: AVX-512 BF16, AMX; Arm: the BF16 extension)
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path | None = None) -> frozenset[str]:
    """The first processor's feature flags (x86's ``flags`` line, Arm's ``Features``) in cpuinfo
    (CPUINFO when None); empty where it cannot be read (not Linux)."""
    try:
        with (cpuinfo or CPUINFO).open() as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def bf16_unsupported_reason(flags: Iterable[str] | None = None) -> str | None:
    """Why bfloat16 would not run natively on this CPU (flags: its feature flags, read from
    /proc/cpuinfo when None); None where it would."""
    have = cpu_flags() if flags is None else frozenset(flags)
    if any(flag in have for flag in BF16_FLAGS):
        return None
    if not have:
        return "the CPU's feature flags cannot be read (/proc/cpuinfo), so no AVX-512 BF16 or AMX is known"
    return "the CPU has neither AVX-512 BF16 (avx512_bf16) nor AMX (amx_bf16)"


def cpu_dtype(requested: torch.dtype, flags: Iterable[str] | None = None) -> torch.dtype:
    """The dtype a CPU computes a model asked for in `requested` in: float32 for bfloat16 where the CPU
    lacks native bfloat16 (logged as a warning), else `requested`."""
    if requested != torch.bfloat16:
        return requested
    reason = bf16_unsupported_reason(flags)
    if reason is None:
        return requested
    log.warning(
        "--dtype bfloat16 on this CPU runs in float32 instead: %s, without which bfloat16 products are "
        "emulated and slower than float32's (twice the weight memory; the KV cache holds half the tokens)",
        reason,
    )
    return torch.float32
