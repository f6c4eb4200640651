"""A same-run reference for the decode step: transformers' model over its static KV cache, the
decode step under `torch.compile(mode="reduce-overhead")` (CUDA graphs), gpt-fast style.

It decodes greedily with a fixed batch and a fixed prompt length: a prefill over the prompt, then
one compiled forward per token. `decode_step_s` is the median time of one step over a timed run
of steps; `prefill_s` the time of one prefill of B × P tokens (eager). Each batch size and length
gets its own cache, sized to the run, and its own specialised graph (`dynamic=False`). On a CPU it runs the same
code with `torch.compile`'s default mode (no graphs), or uncompiled with `compile_mode=None`.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _static_cache(model: Any, batch: int, max_len: int, device: str, dtype: torch.dtype) -> Any:
    from transformers import StaticCache

    try:  # transformers 5: the batch size is taken from the first update
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # transformers 4.4x-4.5x
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=max_len, device=device, dtype=dtype)


class StaticReference:
    def __init__(
        self, model_path: str, device: str, dtype: str, max_len: int, compile_mode: str | None = "reduce-overhead"
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.dtype = getattr(torch, dtype)
        started = time.monotonic()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(device).eval()
        self.load_s = time.monotonic() - started
        self.compile_mode = compile_mode if device.startswith("cuda") or compile_mode is None else "default"
        self.compile_s: dict[int, float] = {}
        self._decode: Any = None
        self.max_len = max_len
        self.fullgraph = True
        self._caches: dict[tuple[int, int], Any] = {}  # per batch size and length, reused: a new one recompiles

    def weight_bytes(self) -> int:
        embed = self.model.get_input_embeddings().weight
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p is not embed)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(input_ids=ids, cache_position=positions, past_key_values=cache, use_cache=True)
        return out.logits[:, -1, :]

    def _step(self, token: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        return self._forward(token, positions, cache).argmax(-1, keepdim=True)

    def _decoder(self) -> Any:
        """One decode step, greedy sampling included (as gpt-fast compiles it)."""
        if self._decode is None:
            fn = self._step
            if self.compile_mode is not None:
                fn = torch.compile(fn, mode=self.compile_mode, fullgraph=self.fullgraph, dynamic=False)
            self._decode = fn
        return self._decode

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], steps: int, warm: int = 3) -> dict:
        """Greedy decode of `steps` tokens after the prompts (all of one length); returns the step
        time and the tokens (the first from the prefill, then one per step)."""
        batch, length = len(prompts), len(prompts[0])
        # sized to the run, as gpt-fast sizes it: a static cache's attention reads every slot
        need = length + steps + 1
        assert need <= self.max_len, "the reference's cache is too short"
        if (batch, need) not in self._caches:
            self._caches[(batch, need)] = _static_cache(self.model, batch, need, self.device, self.dtype)
        cache = self._caches[(batch, need)]
        cache.reset()
        ids = torch.tensor(prompts, device=self.device)
        _sync(self.device)
        started = time.perf_counter()
        logits = self._forward(ids, torch.arange(length, device=self.device), cache)
        token = logits.argmax(-1, keepdim=True)
        _sync(self.device)
        prefill_s = time.perf_counter() - started
        tokens = [token]
        position = length
        # the first steps compile (and capture) for this batch size; they are not timed
        started = time.perf_counter()
        for i in range(min(warm, steps)):
            try:
                token = self._decoder()(token.clone(), torch.tensor([position], device=self.device), cache)
            except Exception as error:  # a graph break the installed transformers has: compile it in pieces
                if i or self.compile_mode is None or not self.fullgraph:
                    raise
                print(f"reference: fullgraph compile failed ({type(error).__name__}: {error}); compiling in pieces")
                self.fullgraph, self._decode = False, None
                return self.run(prompts, steps, warm)
            tokens.append(token.clone())  # a CUDA graph's output is overwritten by the next replay
            position += 1
        decode = self._decoder()
        _sync(self.device)
        self.compile_s.setdefault(batch, time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(steps - warm):
            token = decode(token.clone(), torch.tensor([position], device=self.device), cache)
            tokens.append(token.clone())
            position += 1
        _sync(self.device)
        elapsed = time.perf_counter() - started
        out = torch.cat(tokens, dim=1).tolist()
        return {"step_s": elapsed / max(1, steps - warm), "prefill_s": prefill_s, "tokens": out}
