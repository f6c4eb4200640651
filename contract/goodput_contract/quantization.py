"""Weight quantization: the methods, how the runtime stores their weights, and where each can run.

Every method stores each decoder linear weight in one byte plus one float32 scale per output
channel; embeddings, norms, biases and (unless asked) the LM head stay in the compute dtype.
``int8`` is weight-only: activations stay in the compute dtype, so outputs stay closest to the
unquantized model. ``int8-w8a8`` also rounds each token's activations to int8 on the fly and
multiplies int8 by int8 (faster on CPU, less accurate). ``fp8`` stores e4m3 weights and needs
an NVIDIA GPU of compute capability 8.9 or newer. The operator checks
what it knows before a pod starts (no GPU, or a GPU product of known capability); the runtime
checks the device it finds. Both word a refusal with ``capability_problem``.
"""

from __future__ import annotations

NONE = "none"
INT8 = "int8"  # weight-only
INT8_W8A8 = "int8-w8a8"  # int8 weights and per-token int8 activations
FP8 = "fp8"
METHODS = (NONE, INT8, INT8_W8A8, FP8)

WEIGHT_BYTES = {INT8: 1, INT8_W8A8: 1, FP8: 1}  # bytes of one quantized weight
SCALE_BYTES = 4  # one float32 scale per output channel

# the oldest CUDA compute capability that can run a method; methods absent here run anywhere
MIN_CAPABILITY: dict[str, tuple[int, int]] = {FP8: (8, 9)}
FP8_MIN_CAPABILITY = MIN_CAPABILITY[FP8]
_GENERATIONS = {(8, 9): "Ada, Hopper"}


def method_problem(method: str) -> str | None:
    """Why ``method`` is not a quantization method; None when it is."""
    if method in METHODS:
        return None
    return f"unknown quantization method {method!r}; choose one of {', '.join(METHODS)}"


def requirement(method: str) -> str | None:
    """What hardware ``method`` needs, in words; None when it runs anywhere."""
    need = MIN_CAPABILITY.get(method)
    if need is None:
        return None
    generations = f" ({_GENERATIONS[need]})" if need in _GENERATIONS else ""
    return f"{method} weights need an NVIDIA GPU with compute capability {need[0]}.{need[1]} or newer{generations}"


def supported(method: str, capability: tuple[int, int] | None) -> bool:
    """Whether ``method`` runs on an NVIDIA GPU of ``capability`` (None: no NVIDIA GPU at all)."""
    need = MIN_CAPABILITY.get(method)
    return need is None or (capability is not None and capability >= need)


def capability_problem(method: str, capability: tuple[int, int] | None, found: str) -> str | None:
    """Why ``method`` cannot run on a GPU of ``capability`` (None: no NVIDIA GPU), ending with
    ``found``, what the caller saw; None when it can."""
    if supported(method, capability):
        return None
    return f"{requirement(method)}; {found}"
