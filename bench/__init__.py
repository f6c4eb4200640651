"""Benchmarks: a load generator for OpenAI-compatible servers and a same-machine comparison."""
