"""Finding and loading a model: local directories, GGUF files and Hugging Face ids, one architecture table.

A model is a path: a Hugging Face model directory (config.json, safetensors, tokenizer), or a
GGUF file (llama.cpp's format, one file holding weights, tokenizer and chat template), given as
the file itself or as a directory holding exactly one ``.gguf`` and no config.json. GGUF files
load through transformers' GGUF support, which dequantizes every tensor to the compute dtype;
a file with tensors of a type it cannot dequantize is refused, naming the type.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from goodput_contract import gguf
from goodput_contract.architectures import architecture_problem

log = logging.getLogger(__name__)

HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
HUB_GGUF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)/(?P<file>(?:[\w.-]+/)*[\w.-]+\.gguf)$")


class ModelLoadError(RuntimeError):
    """The model cannot be found or is not one the runtime can serve."""


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local directory or ``.gguf`` file as is; ``hf://org/name`` or ``org/name`` through the Hugging
    Face cache, and ``hf://org/name/file.gguf`` as that one file of the repository.

    Downloads honour HF_ENDPOINT, HF_TOKEN, HF_HOME and HF_HUB_OFFLINE like every hub client.
    """
    if model.startswith("file://"):
        model = model[len("file://") :]
    local = Path(model).expanduser()
    if local.is_dir():
        check_readable(local)
        return local
    if local.is_file():
        if local.suffix != gguf.SUFFIX:
            raise ModelLoadError(
                f"{model} is a file but not a GGUF file (.gguf); give a model directory, "
                "a .gguf file or a Hugging Face id"
            )
        check_readable(local.parent, [local])
        return local
    if model.startswith(("/", ".", "~")):
        raise ModelLoadError(f"model {'file' if model.endswith(gguf.SUFFIX) else 'directory'} {model} does not exist")
    repo_id = model.removeprefix("hf://")
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    token = os.environ.get("HF_TOKEN") or None
    single = HUB_GGUF.match(repo_id)
    try:
        if single:
            return Path(hf_hub_download(single["repo"], single["file"], revision=revision, token=token))
        path = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES, token=token)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot fetch model {repo_id!r} (revision {revision or 'main'}): {exc}") from exc
    return Path(path)


def check_readable(model_dir: Path, files: list[Path] | None = None) -> None:
    """Refuse a local model whose files this process cannot read (a volume written by another
    user), naming the files, rather than failing later with a misleading error."""
    candidates = files if files is not None else sorted(model_dir.iterdir())
    unreadable = [p.name for p in candidates if p.is_file() and not os.access(p, os.R_OK)]
    if unreadable:
        raise ModelLoadError(
            f"cannot read {', '.join(unreadable[:5])}{' ...' if len(unreadable) > 5 else ''} in {model_dir} "
            f"as uid {os.getuid()}: permission denied (make the files readable, e.g. chmod -R a+rX)"
        )


def gguf_file(model_path: Path) -> Path | None:
    """The GGUF file a model path names (the file itself, or the one ``.gguf`` in a directory
    without config.json); None for a Hugging Face model directory."""
    if model_path.is_file():
        return model_path
    if (model_path / "config.json").exists():
        return None
    found = sorted(p for p in model_path.glob(f"*{gguf.SUFFIX}") if p.is_file())
    if len(found) > 1:
        raise ModelLoadError(
            f"{model_path} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
            f"give the one to serve as --model {model_path}/<file>.gguf"
        )
    return found[0] if found else None


def pretrained_args(model_path: Path) -> tuple[Path, dict[str, Any]]:
    """What transformers' ``from_pretrained`` takes for this model: the directory, and ``gguf_file``."""
    file = gguf_file(model_path)
    if file is None:
        return model_path, {}
    return file.parent, {"gguf_file": file.name}


@functools.cache
def dequantizable_types() -> tuple[str, ...]:
    """The GGML tensor types transformers' GGUF loader can dequantize here: each one it turns
    into floats with the installed ``gguf`` package, tried on one block of zeros."""
    try:
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize
    except ImportError as exc:
        raise ModelLoadError("loading a GGUF file needs the gguf package (pip install 'goodput[runtime]')") from exc
    names = []
    for qtype in GGMLQuantizationType:
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros(block_bytes, dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError):
            continue
        names.append(qtype.name)
    return tuple(names)


def read_gguf(file: Path) -> gguf.GGUFHeader:
    """The file's header, after checking transformers can dequantize every tensor in it."""
    try:
        header = gguf.read_header(file)
    except (gguf.GGUFError, OSError) as exc:
        raise ModelLoadError(str(exc)) from exc
    problem = gguf.quantization_problem(header, dequantizable_types(), str(file))
    if problem:
        raise ModelLoadError(problem)
    return header


def check_architecture(model_path: Path) -> dict:
    """The model's config (config.json, or what its GGUF metadata implies), after checking the
    runtime supports its architecture and, for GGUF, can load its tensor types."""
    file = gguf_file(model_path)
    if file is not None:
        config = gguf.hf_config(read_gguf(file))
        where = f"the GGUF metadata of {file}"
    else:
        config_file = model_path / "config.json"
        if not config_file.exists():
            raise ModelLoadError(f"{model_path} has no config.json and no .gguf file: not a model directory")
        config = json.loads(config_file.read_text())
        where = str(config_file)
    problem = architecture_problem(config.get("architectures") or [], where)
    if problem:
        raise ModelLoadError(problem)
    return config


def load_config(model_path: Path):
    """transformers' config of the model (read from the GGUF metadata for a GGUF file)."""
    from transformers import AutoConfig

    directory, kwargs = pretrained_args(model_path)
    return AutoConfig.from_pretrained(directory, **kwargs)


def load_tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    directory, kwargs = pretrained_args(model_path)
    return AutoTokenizer.from_pretrained(directory, **kwargs)


def load_model(model_path: Path, dtype, device, attn_implementation: str):
    """transformers' model code and weights, with attention routed to ``attn_implementation``
    (registered with transformers' attention interface beforehand)."""
    from transformers import AutoModelForCausalLM

    check_architecture(model_path)
    directory, kwargs = pretrained_args(model_path)
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation=attn_implementation, **kwargs
    )
    model.to(device)
    model.eval()
    log.info("Loaded %s (%s) on %s as %s", model_path, type(model).__name__, device, dtype)
    return model
