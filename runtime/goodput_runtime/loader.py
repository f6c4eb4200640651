"""Finding and loading a model: local directories and Hugging Face ids, one architecture table."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from goodput_contract.architectures import architecture_problem

log = logging.getLogger(__name__)

HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


class ModelLoadError(RuntimeError):
    """The model cannot be found or is not one the runtime can serve."""


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local directory as is; ``hf://org/name`` or ``org/name`` through the Hugging Face cache.

    Downloads honour HF_ENDPOINT, HF_TOKEN, HF_HOME and HF_HUB_OFFLINE like every hub client.
    """
    if model.startswith("file://"):
        model = model[len("file://") :]
    local = Path(model).expanduser()
    if local.is_dir():
        check_readable(local)
        return local
    if model.startswith(("/", ".", "~")):
        raise ModelLoadError(f"model directory {model} does not exist")
    repo_id = model.removeprefix("hf://")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES,
                                 token=os.environ.get("HF_TOKEN") or None)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot fetch model {repo_id!r} (revision {revision or 'main'}): {exc}") from exc
    return Path(path)


def check_readable(model_dir: Path) -> None:
    """Refuse a local model whose files this process cannot read (a volume written by another
    user), naming the files, rather than failing later with a misleading error."""
    unreadable = [p.name for p in sorted(model_dir.iterdir()) if p.is_file() and not os.access(p, os.R_OK)]
    if unreadable:
        raise ModelLoadError(
            f"cannot read {', '.join(unreadable[:5])}{' ...' if len(unreadable) > 5 else ''} in {model_dir} "
            f"as uid {os.getuid()}: permission denied (make the files readable, e.g. chmod -R a+rX)"
        )


def check_architecture(model_dir: Path) -> dict:
    """The model's config.json, after checking the runtime supports its architecture."""
    config_file = model_dir / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    config = json.loads(config_file.read_text())
    problem = architecture_problem(config.get("architectures") or [], str(config_file))
    if problem:
        raise ModelLoadError(problem)
    return config


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def load_model(model_dir: Path, dtype, device, attn_implementation: str):
    """transformers' model code and weights, with attention routed to ``attn_implementation``
    (registered with transformers' attention interface beforehand)."""
    from transformers import AutoModelForCausalLM

    check_architecture(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn_implementation)
    model.to(device)
    model.eval()
    log.info("Loaded %s (%s) on %s as %s", model_dir, type(model).__name__, device, dtype)
    return model
