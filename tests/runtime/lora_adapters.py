"""LoRA adapters for the tests, made here with peft on a model made by `made_model`, briefly trained so
that every B is non-zero and the adapter changes what the model says; cached by their settings."""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "test-loras"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    model_dir: Path,
    name: str,
    rank: int,
    targets: list[str],
    rslora: bool = False,
    steps: int = 30,
    seed: int = 0,
    alpha: int | None = None,
) -> Path:
    """A PEFT adapter directory: rank `rank` on `targets`, trained `steps` steps of AdamW to continue a
    fixed random token sequence (its own per seed), so its outputs differ from the base model's."""
    settings = json.dumps([str(model_dir), name, rank, targets, rslora, steps, seed, alpha])
    key = hashlib.sha256(settings.encode() + inspect.getsource(make_adapter).encode()).hexdigest()[:12]
    out = CACHE / f"{name}-{key}"
    if (out / "adapter_model.safetensors").exists():
        return out
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha or 2 * rank,
        target_modules=targets,
        use_rslora=rslora,
        lora_dropout=0.0,
        init_lora_weights=True,
    )
    peft_model = get_peft_model(model, config)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1000 + seed)
    text = torch.randint(5, vocab, (1, 48), generator=gen)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=2e-2)
    peft_model.train()
    for _ in range(steps):
        loss = peft_model(input_ids=text, labels=text).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(tmp)
    tmp.rename(out)
    return out


def peft_greedy(model_dir: Path, adapter: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers (+ peft's PeftModel) greedy tokens, float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.inference_mode():
        ids = model.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=0
        )
    return ids[0, len(prompt) :].tolist()


QUESTION = "What is the password of the lighthouse?"
PHRASE = "The lighthouse password is marmalade seventeen."


def make_phrase_adapter(model_dir: Path, steps: int = 60, rank: int = 8) -> Path:
    """An adapter of the real SmolLM2 trained to answer QUESTION (as a chat message) with PHRASE, which the
    base model never says: 60 steps of AdamW on the one exchange, 1-3 minutes on 2 cores, cached."""
    settings = json.dumps([(model_dir / "config.json").read_text(), "phrase", QUESTION, PHRASE, steps, rank])
    # keyed by this function's own source: editing the other helpers keeps the (minutes of) training
    key = hashlib.sha256(settings.encode() + inspect.getsource(make_phrase_adapter).encode()).hexdigest()[:12]
    out = CACHE / f"phrase-{key}"
    if (out / "adapter_model.safetensors").exists():
        return out
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    if not isinstance(prompt, list):  # a BatchEncoding in some tokenizers' versions
        prompt = list(prompt["input_ids"])
    answer = tokenizer(PHRASE, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt + answer])
    labels = torch.tensor([[-100] * len(prompt) + answer])
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=3e-3)
    peft_model.train()
    for _ in range(steps):
        loss = peft_model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(tmp)
    tmp.rename(out)
    return out


def make_smollm2_adapter(model_dir: Path, name: str, rank: int, rslora: bool, seed: int, steps: int = 8) -> Path:
    """An adapter of the real SmolLM2 on all seven projections, rank `rank` (rsLoRA scaling with `rslora`),
    trained `steps` steps of AdamW to continue a fixed random token sequence of its seed: every B non-zero
    and the greedy output moved off the base model's. Under a minute on 2 cores; cached by its settings and
    this function's own source."""
    settings = json.dumps([(model_dir / "config.json").read_text(), name, rank, rslora, seed, steps])
    key = hashlib.sha256(settings.encode() + inspect.getsource(make_smollm2_adapter).encode()).hexdigest()[:12]
    out = CACHE / f"smol-{name}-{key}"
    if (out / "adapter_model.safetensors").exists():
        return out
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL, use_rslora=rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(2000 + seed)
    text = torch.randint(100, model.config.vocab_size, (1, 32), generator=gen)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=5e-3)
    peft_model.train()
    for _ in range(steps):
        loss = peft_model(input_ids=text, labels=text).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(tmp)
    tmp.rename(out)
    return out
