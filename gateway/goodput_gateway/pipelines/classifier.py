"""The classifier guard: one short request to an InferenceService, whose answer decides allow or block.

The answer is constrained to its first token without the runtime's help: the request asks for
one token at temperature 0 with the top log-probabilities, and the first candidate (most
likely first) that begins an allow word or a block word, and not both, decides. A runtime
with structured output could instead be sent the words as choices and answer one of them
whole; `decide` already reads such an answer.
"""

from __future__ import annotations

from typing import Any

from goodput_contract.api.pipeline_spec import ALLOW, BLOCK, INPUT_PLACEHOLDER, Classifier

TOP_LOGPROBS = 20  # the most our runtime (and vLLM by default) returns per token


def request_body(classifier: Classifier, served_name: str, text: str) -> dict[str, Any]:
    return {
        "model": served_name,
        "messages": [{"role": "user", "content": classifier.template.replace(INPUT_PLACEHOLDER, text)}],
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": TOP_LOGPROBS,
        "stream": False,
    }


def _side(classifier: Classifier, token: str) -> str | None:
    word = token.strip().lower()
    if not word:
        return None
    allow = any(w.startswith(word) for w in classifier.allow)
    block = any(w.startswith(word) for w in classifier.block)
    return ALLOW if allow and not block else BLOCK if block and not allow else None


def decide(classifier: Classifier, response: dict[str, Any]) -> tuple[str, str]:
    """(allow | block, the answer that decided it, or "unknown")."""
    choice = (response.get("choices") or [{}])[0]
    answer = str((choice.get("message") or {}).get("content") or "").strip().lower()
    if answer in classifier.allow:
        return ALLOW, answer
    if answer in classifier.block:
        return BLOCK, answer
    candidates = ((choice.get("logprobs") or {}).get("content") or [{}])[0].get("top_logprobs") or ()
    for candidate in sorted(candidates, key=lambda c: -float(c.get("logprob", float("-inf")))):
        side = _side(classifier, str(candidate.get("token", "")))
        if side is not None:
            return side, str(candidate.get("token", "")).strip().lower()
    return classifier.on_unknown, "unknown"
