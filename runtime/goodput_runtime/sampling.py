"""Per-request sampling settings, validated at the HTTP edge, and the model's own defaults."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # the most top logprobs a request may ask for, per token
MAX_N = 16  # the most choices one request may ask for
SEED_MODULUS = 2**64

# generation_config.json keys applied where a request is silent, as vLLM applies them
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16  # 0 only with prompt logprobs (echo): nothing is generated
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0  # tokens less likely than min_p times the likeliest one are dropped
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # choices, forked from one prefill
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence among the generated tokens
    # the prompt's last tokens that are this request's own earlier output (a stream taken up on another
    # replica: its prompt is the original prompt's ids and those produced so far): the presence and
    # frequency penalties count them as generated tokens
    output_in_prompt: int = 0
    repetition_penalty: float = 1.0  # HF's: divides positive, multiplies negative logits of prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # EOS, stop tokens and stop strings are held off until this many are generated
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k likeliest
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob and the k likeliest
    priority: int = 0  # vLLM's convention: lower is served first; above 0 is batch work
    lora: str | None = None  # the LoRA adapter the request names as its model; None: the base model
    slo_ttft: float | None = None  # the request's own targets, seconds (server/request_slo.py); None: the server's
    slo_tpot: float | None = None
    # a compiled grammar (structured/grammar.py) the output must follow; each choice gets its own matcher
    grammar: Any = field(default=None, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """True when the logits are changed before sampling (penalties, bias, a minimum length)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def choice_seed(self, index: int) -> int | None:
        """Choice `index`'s own seed: the request's seed plus its index, within 64 bits."""
        if self.seed is None:
            return None
        seed = self.seed + index
        return seed - SEED_MODULUS if seed >= SEED_MODULUS else seed


def generation_defaults(generation_config: Any) -> dict[str, float | int]:
    """The sampling settings a model's generation_config.json recommends, for requests silent on them.

    Like vLLM, only values the file sets (its difference from transformers' defaults) count, and
    `max_new_tokens` becomes the default `max_tokens`.
    """
    if generation_config is None:
        return {}
    try:
        diff = generation_config.to_diff_dict()
    except AttributeError:
        diff = dict(vars(generation_config))
    defaults: dict[str, float | int] = {}
    for key in GENERATION_DEFAULT_KEYS:
        value = diff.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            defaults["max_tokens" if key == "max_new_tokens" else key] = value
    if defaults:
        log.info(
            "Sampling defaults from the model's generation_config.json, used where a request is silent: %s",
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )
    else:
        log.info("The model's generation_config.json sets no sampling defaults; OpenAI's defaults apply")
    return defaults
