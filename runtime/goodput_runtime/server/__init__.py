"""The OpenAI-compatible HTTP API over aiohttp: parsing and validation (``protocol``), SLO-aware
admission, streaming, embeddings, tokenize, health and metrics; it drives the engine through
``goodput_runtime.engine.client.EngineClient`` only."""
