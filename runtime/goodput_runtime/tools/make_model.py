"""Make a small Llama-architecture model with random weights and a locally trained tokenizer.

The result is an ordinary Hugging Face model directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json), loadable by transformers and by the runtime, made
without any download. Tests, benchmarks and demos use it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import pkgutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096


SHAPES = {
    # ~0.2M parameters: unit and server tests
    "tiny": ModelShape(64, 2, 4, 2, 128, 1024),
    # ~59M parameters: benchmarks
    "60m": ModelShape(512, 12, 8, 4, 1792, 16000),
    # ~1.1B parameters (TinyLlama's shape): GPU decode benchmarks, where only speed matters
    "1b": ModelShape(2048, 22, 32, 4, 5632, 32000),
}


def corpus_lines(limit_chars: int = 3_000_000) -> list[str]:
    """English-like text available on every machine: the standard library's docstrings."""
    lines: list[str] = []
    total = 0
    for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        if info.name.startswith("_") or info.name in {"antigravity", "this", "idlelib", "tkinter", "turtle"}:
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:
            continue
        for obj in [module, *vars(module).values()]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str):
                for line in doc.splitlines():
                    line = line.strip()
                    if len(line) > 20:
                        lines.append(line)
                        total += len(line)
        if total > limit_chars:
            break
    return lines


def train_tokenizer(vocab_size: int, lines: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def make_model(
    out_dir: str | Path,
    shape: str | ModelShape = "tiny",
    seed: int = 0,
    chat_template: bool = True,
    architecture: str = "llama",
    dtype: str = "float32",
) -> Path:
    """Write a random-weight model and a trained tokenizer to ``out_dir``; return the path."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dims = SHAPES[shape] if isinstance(shape, str) else shape

    raw = train_tokenizer(dims.vocab_size, corpus_lines())
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="<|im_end|>" if chat_template else "</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=dims.max_position_embeddings,
    )
    if chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out)

    config = AutoConfig.for_model(
        architecture,
        hidden_size=dims.hidden_size,
        num_hidden_layers=dims.num_layers,
        num_attention_heads=dims.num_heads,
        num_key_value_heads=dims.num_kv_heads,
        intermediate_size=dims.intermediate_size,
        vocab_size=len(tokenizer),
        max_position_embeddings=dims.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        # wide weights make the top logit stand clear of the rest, so greedy decoding is stable
        initializer_range=0.1,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
        model.config.dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    log.info("Made %s model with %d parameters in %s", architecture, params, out)
    (out / "goodput-model.json").write_text(json.dumps({"parameters": params, "shape": vars(dims)}))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="directory to write the model into")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--architecture", default="llama", help="llama, qwen2 or mistral")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-chat-template", action="store_true")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the saved weights"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if (Path(args.out) / "config.json").exists():
        log.info("Model already present in %s", args.out)
        return
    make_model(args.out, args.shape, args.seed, not args.no_chat_template, args.architecture, args.dtype)


if __name__ == "__main__":
    main()
