"""Goodput's serving runtime: the process in every serving pod (``python -m goodput_runtime``).

Its floors run one way, each importing only those below it: ``layers`` (attention, kernels, quantized
linears) ← ``models`` (the compact model modules) ← ``engine`` (scheduling, KV bookkeeping, the model
runner, speculative decoding) ← ``server`` (the OpenAI-compatible HTTP API, through the engine's
``EngineClient``). ``tests/unit/test_boundaries.py`` checks it.
"""
