"""The two transformers baselines, run in this process on an offline batch (all requests at t=0).

- continuous batching: transformers' own paged-cache manager (the engine behind
  `generate_batch`), with an explicitly sized cache and each request's own max_new_tokens;
- static batching: left-padded `model.generate` over fixed batches, every row generating
  up to the batch's longest wanted output.

Greedy, EOS ignored, fp32. Times are perf_counter seconds from the moment the batch is handed over.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from bench.workload import WorkItem


@dataclass
class SystemRun:
    system: str
    wall_s: float
    useful_output_tokens: int  # each request's own wanted tokens, nothing past them
    computed_output_tokens: int  # including rows padded past their own length
    ttft_s: list[float]  # per request, from t=0
    e2e_s: list[float]  # per request, from t=0 to its last wanted token
    outputs: list[list[int]]  # per request, the wanted tokens
    config: dict = field(default_factory=dict)
    notes: str = ""
    texts: list[str] = field(default_factory=list)  # per request, when only text came back
    cpu_s: float | None = None  # CPU time (all threads) spent over wall_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.useful_output_tokens / self.wall_s


def load_model(model_dir: str, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


def cb_cache_blocks(items: list[WorkItem], page_size: int) -> int:
    """Blocks for every request's full prompt + output at once: the batch never waits for memory."""
    return sum(math.ceil((len(i.prompt_ids) + i.max_tokens) / page_size) for i in items) + len(items)


def run_transformers_cb(
    model, items: list[WorkItem], max_batch_tokens: int, page_size: int = 256, max_seqs: int = 64
) -> SystemRun:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    num_blocks = cb_cache_blocks(items, page_size)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(i.max_tokens for i in items))
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_seqs,
        allow_block_sharing=False,
        seed=0,
    )
    results = {}
    # the manager's own thread sets its grad mode; inference_mode here breaks its in-place resets
    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=60, warmup=True
    ) as manager:
        t0, cpu0 = time.perf_counter(), time.process_time()
        for item in items:
            # add_request, unlike generate_batch, takes a max_new_tokens per request
            manager.add_request(
                input_ids=item.prompt_ids,
                request_id=f"req-{item.index}",
                max_new_tokens=item.max_tokens,
                record_timestamps=True,
                eos_token_id=-1,
            )
        while len(results) < len(items):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers continuous batching stopped before finishing the batch")
        wall = max(r.lifespan[1] for r in results.values()) - t0
        cpu = time.process_time() - cpu0
    ordered = [results[f"req-{i.index}"] for i in items]
    failed = [r.request_id for r in ordered if r.error is not None]
    if failed:
        raise RuntimeError(f"transformers continuous batching failed requests {failed}")
    return SystemRun(
        system="transformers-cb",
        wall_s=wall,
        useful_output_tokens=sum(
            min(len(r.generated_tokens), i.max_tokens) for r, i in zip(ordered, items, strict=True)
        ),
        computed_output_tokens=sum(len(r.generated_tokens) for r in ordered),
        ttft_s=[r.timestamps[0] - t0 for r in ordered],
        e2e_s=[r.timestamps[-1] - t0 for r in ordered],
        outputs=[list(r.generated_tokens) for r in ordered],
        cpu_s=cpu,
        config={
            "page_size": page_size,
            "num_blocks": num_blocks,
            "max_batch_tokens": max_batch_tokens,
            "max_requests_per_batch": max_seqs,
            "attn_implementation": model.config._attn_implementation,
        },
        notes="ContinuousBatchingManager.add_request per request (own max_new_tokens); TTFT and e2e from the "
        "manager's per-token timestamps (record_timestamps=True); warm-up and cache allocation before t=0",
    )


class StepClock:
    """A generate() streamer that stamps the time of every decoding step (the first put is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.steps: list[float] = []

    def put(self, value) -> None:
        self.puts += 1
        if self.puts > 1:
            self.steps.append(time.perf_counter())

    def end(self) -> None:
        pass


def left_pad(batch: list[WorkItem], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(i.prompt_ids) for i in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, item in enumerate(batch):
        n = len(item.prompt_ids)
        ids[row, width - n :] = torch.tensor(item.prompt_ids)
        mask[row, width - n :] = 1
    return ids, mask  # [B, S] each


def run_static(model, items: list[WorkItem], batch_size: int, pad_id: int) -> SystemRun:
    from transformers import GenerationConfig

    ttft: list[float] = []
    e2e: list[float] = []
    outputs: list[list[int]] = []
    computed = 0
    with torch.inference_mode():
        warm_ids, warm_mask = left_pad(items[:2], pad_id)
        model.generate(
            input_ids=warm_ids, attention_mask=warm_mask, max_new_tokens=2, do_sample=False, pad_token_id=pad_id
        )
    t0, cpu0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for first in range(0, len(items), batch_size):
            batch = items[first : first + batch_size]
            longest = max(i.max_tokens for i in batch)
            ids, mask = left_pad(batch, pad_id)
            clock = StepClock()
            config = GenerationConfig(do_sample=False, max_new_tokens=longest, eos_token_id=None, pad_token_id=pad_id)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, streamer=clock)
            generated = out[:, ids.shape[1] :]  # [B, longest]
            if generated.shape[1] != longest or len(clock.steps) != longest:
                raise RuntimeError(f"static batch stopped after {generated.shape[1]} of {longest} tokens")
            computed += generated.numel()
            for row, item in enumerate(batch):
                outputs.append(generated[row, : item.max_tokens].tolist())
                ttft.append(clock.steps[0] - t0)
                e2e.append(clock.steps[item.max_tokens - 1] - t0)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return SystemRun(
        system="static-batch",
        wall_s=wall,
        useful_output_tokens=sum(i.max_tokens for i in items),
        computed_output_tokens=computed,
        ttft_s=ttft,
        e2e_s=e2e,
        outputs=outputs,
        cpu_s=cpu,
        config={"batch_size": batch_size, "padding": "left", "attn_implementation": model.config._attn_implementation},
        notes="model.generate per fixed batch in arrival order, max_new_tokens = the batch's longest wanted "
        "output; TTFT = time of the batch's first generated token (a streamer stamps every step); "
        "only each request's own wanted tokens count as useful",
    )
