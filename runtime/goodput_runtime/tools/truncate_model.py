"""``python -m goodput_runtime.tools.truncate_model SOURCE TARGET --layers N``: a draft model for
speculative decoding from a model directory: its first N decoder layers, its embeddings, final norm
and LM head, and its tokenizer, so its token ids are the source's."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

LAYER_PREFIX = "model.layers."


def truncated_copy(source: Path, target: Path, layers: int) -> Path:
    """Write the truncated copy of the Hugging Face directory `source` to `target`; return target."""
    config = json.loads((source / "config.json").read_text())
    if not 0 < layers <= config["num_hidden_layers"]:
        raise ValueError(f"--layers must be in 1..{config['num_hidden_layers']}, not {layers}")
    target.mkdir(parents=True, exist_ok=True)
    weights = {}
    for path in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            if name.startswith(LAYER_PREFIX) and int(name[len(LAYER_PREFIX) :].split(".")[0]) >= layers:
                continue
            weights[name] = tensor.contiguous()
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = layers
    for key in ("layer_types", "max_window_layers"):
        if isinstance(config.get(key), list):
            config[key] = config[key][:layers]
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for path in source.iterdir():
        if (
            path.is_file()
            and not path.name.endswith(".safetensors")
            and path.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(path, target / path.name)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m goodput_runtime.tools.truncate_model", description=__doc__)
    parser.add_argument("source", type=Path, help="a Hugging Face model directory (safetensors)")
    parser.add_argument("target", type=Path)
    parser.add_argument("--layers", type=int, required=True, help="decoder layers to keep, from the first")
    args = parser.parse_args(argv)
    print(truncated_copy(args.source, args.target, args.layers))


if __name__ == "__main__":
    main()
