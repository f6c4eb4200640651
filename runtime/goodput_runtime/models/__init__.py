"""The runtime's own model modules, standing in for transformers' where they apply.

``--model-impl auto`` (the default) serves Llama, Mistral and Qwen2 models through the compact
modules of ``llama.py``; any other architecture, a model under tensor parallelism, or
``--model-impl transformers`` runs on transformers' own modules with the paged attention behind its
attention interface. ``implementation.choose`` picks between them; ``support.py`` says which loaded
models the compact modules can stand in for.
"""
