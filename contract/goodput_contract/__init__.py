"""The rules that operator, runtime and gateway must agree on, in one pure-Python package.

It imports nothing beyond the standard library (no torch, no kubernetes client), so every
component can depend on it. Each module holds one kind of rule:

- ``metrics``: the names of the series the runtime exports and the autoscaler and dashboards read.
- ``parallel``: which tensor-parallel sizes can split a model (they must divide its attention
  heads, KV heads and MLP intermediate size), and the message when one cannot.
- ``architectures``: the ``config.json`` architectures the runtime serves.
- ``quantization``: the weight quantization methods, the bytes the runtime stores per weight and
  scale, and the GPU compute capability each method needs (fp8: 8.9 or newer).
- ``flags``: the runtime's command-line flags, and which InferenceService field each one carries.
- ``gguf``: the header of a GGUF model file (metadata and tensor table) and the config.json it
  implies, so the operator sizes a GGUF model and the runtime names its tensor types before loading.
"""
