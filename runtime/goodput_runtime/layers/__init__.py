"""The runtime's floor of layers: what a model's forward pass calls, and nothing above it.

- ``attention``: paged attention over the KV cache, and its registration behind transformers'
  attention interface; ``native_attention`` (C++ kernels built on first use, sources in the
  ``native_*_source`` modules) and ``triton_attention`` run it on CPU and CUDA;
- ``fused``: the decoder's element-wise operations fused on CPU (in the native extension);
- ``triton_linear``: batch-1 projections on CUDA as a Triton GEMV (kernels in ``triton_kernels``);
- ``quantization``: int8 and fp8 quantized linear layers;
- ``step_plan``: how a step's projections run on a CPU (their threads and product form).

Modules here import neither the models nor the engine: ``models/`` builds on them, and the engine
on both.
"""
