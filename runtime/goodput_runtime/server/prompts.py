"""From a validated request to prompt token ids and a token budget that fits the context."""

from __future__ import annotations

import json
from typing import Any

from goodput_runtime.server.errors import invalid
from goodput_runtime.server.protocol import Sampling


def completion_prompt_ids(
    tokenizer: Any, prompt: str | list[int], param: str = "prompt", add_special_tokens: bool = True
) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
    check_vocabulary(tokenizer, prompt, param)
    return prompt


def check_vocabulary(tokenizer: Any, token_ids: list[int], param: str) -> None:
    vocab = len(tokenizer)
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid(f"'{param}' holds token id {bad}, outside the vocabulary [0, {vocab})", param)


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    model: str,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    tools: list[dict] | None = None,
) -> list[int]:
    """The conversation through the model's chat template, with the tools (as transformers'
    apply_chat_template(tools=...) renders them)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise invalid(
            f"Model '{model}' has no chat template, so it cannot serve chat completions; "
            "send a plain prompt to /v1/completions instead",
            "messages",
            "chat_template_missing",
        )
    if not isinstance(template, str) or "tool_calls" not in template:
        messages = [calls_as_text(m) for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools or None,
        )
    except Exception as exc:  # a template may refuse a conversation in any way it likes
        raise invalid(f"The model's chat template refused these messages: {exc}", "messages") from None
    # the template already holds every special token the model expects (unless asked for more)
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def check_token_ids(tokenizer: Any, sampling: Sampling) -> None:
    vocab = len(tokenizer)
    bad = next((t for t in sampling.stop_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid(f"'stop_token_ids' holds {bad}, outside the vocabulary [0, {vocab})", "stop_token_ids")
    bad = next((t for t, _ in sampling.logit_bias if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid(f"'logit_bias' names token {bad}, outside the vocabulary [0, {vocab})", "logit_bias")


def token_budget(sampling: Sampling, num_prompt_tokens: int, max_model_len: int, prompt_param: str) -> int:
    """max_tokens as asked, or all the room the context leaves; 400 when the two do not fit."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise invalid(
            f"This model's maximum context length is {max_model_len} tokens, but '{prompt_param}' "
            f"holds {num_prompt_tokens} tokens, leaving no room for output. Shorten it.",
            prompt_param,
            "context_length_exceeded",
        )
    if sampling.max_tokens is None:
        return room
    if sampling.max_tokens > room:
        raise invalid(
            f"This model's maximum context length is {max_model_len} tokens, but "
            f"{num_prompt_tokens + sampling.max_tokens} were requested ({num_prompt_tokens} in "
            f"'{prompt_param}', {sampling.max_tokens} in '{sampling.max_tokens_param}'). Lower "
            f"'{sampling.max_tokens_param}' or shorten the prompt.",
            sampling.max_tokens_param,
            "context_length_exceeded",
        )
    return sampling.max_tokens


def calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant's tool calls written into its content (in the Hermes format), for a chat template that
    renders content alone: the model still sees what it called."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        + "\n</tool_call>"
        for c in calls
    )
    content = message.get("content") or ""
    return {**message, "content": f"{content}\n{written}" if content else written}
