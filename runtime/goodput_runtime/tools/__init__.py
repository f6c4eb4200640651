"""Command-line tools beside the server: random-weight test models, the SmolLM2 wheel, truncated models."""
