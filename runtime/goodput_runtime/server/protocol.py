"""Validation of OpenAI request bodies into plain dataclasses; every error names its field.

The fields' readers live by idea: fields.py (one field's type and bounds), guide_fields.py (structured
output), tool_fields.py (tools), chat_messages.py (messages); their names used elsewhere are
re-exported here."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from goodput_runtime.sampling import MAX_LOGPROBS, MAX_N, SamplingParams
from goodput_runtime.server.chat_messages import ROLES, chat_messages
from goodput_runtime.server.errors import invalid, missing, wrong_type
from goodput_runtime.server.fields import (
    boolean,
    int_in,
    int_list,
    is_int,
    is_number,
    logit_bias,
    max_tokens_field,
    number,
    optional_int,
    optional_number,
    parse_json,
    reject_unknown,
    reject_unsupported,
    shown,
    stop_strings,
)
from goodput_runtime.server.guide_fields import Guide, guide
from goodput_runtime.server.tool_fields import Tool, tool_call_spec, tool_choice, tool_list

__all__ = [
    "CHAT_LOGPROBS",
    "CHAT_LOGPROBS_HEADER",
    "RESUME_GRAMMAR_HEADER",
    "RESUME_OUTPUT_IDS",
    "RESUME_OUTPUT_IDS_HEADER",
    "ROLES",
    "SEED_RANGE",
    "ChatRequest",
    "CompletionRequest",
    "Guide",
    "Sampling",
    "Tool",
    "boolean",
    "chat_messages",
    "completion_prompt",
    "guide",
    "header_priority",
    "include_usage",
    "int_in",
    "int_list",
    "is_int",
    "is_number",
    "logit_bias",
    "max_tokens_field",
    "model_name",
    "number",
    "optional_int",
    "optional_number",
    "parse_chat",
    "parse_completion",
    "parse_json",
    "reject_unknown",
    "reject_unsupported",
    "sampling",
    "shown",
    "stop_strings",
    "tool_call_spec",
    "tool_choice",
    "tool_list",
]

SEED_RANGE = (-(2**63), 2**64 - 1)
# our extension on /v1/completions: the prompt's last K ids are the request's own earlier output (a stream
# taken up on another replica), counted as output by the presence and frequency penalties; the answer says
# it took them in its header RESUME_OUTPUT_IDS_HEADER (K), which a runtime that ignores the field never sends.
# A request with a grammar (structured output) has it go on from where those K ids left it, said by the
# header RESUME_GRAMMAR_HEADER (K); ids the grammar refuses are a 400 naming the field.
RESUME_OUTPUT_IDS = "resume_output_ids"
RESUME_OUTPUT_IDS_HEADER = "x-goodput-resume-output-ids"
RESUME_GRAMMAR_HEADER = "x-goodput-resume-grammar"
# our extension on /v1/completions, with `logprobs`: each token's logprobs in a chat completion's shape
# ({"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}), so a chat stream taken up as a
# completion reports them as it would have; said by the header CHAT_LOGPROBS_HEADER ("true")
CHAT_LOGPROBS = "chat_logprobs"
CHAT_LOGPROBS_HEADER = "x-goodput-chat-logprobs"


@dataclass(frozen=True, slots=True)
class Sampling:
    """A request's sampling fields; None where it is silent and the model's defaults may apply."""

    max_tokens: int | None  # None: the model's default, or whatever room the context leaves
    max_tokens_param: str
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    n: int = 1
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # top logprobs per token; None: no logprobs at all
    echo: bool = False  # completions: the prompt comes first in each choice (with its logprobs if asked)
    priority: int | None = None  # vLLM's: lower first, above 0 is batch work; None: the header's, else 0
    # completions: the prompt's last ids that are the request's own earlier output (`resume_output_ids`)
    output_in_prompt: int = 0

    def params(self, max_tokens: int, defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """Engine settings: the request's own values, else the model's defaults, else OpenAI's."""
        defaults = defaults or {}

        def pick(value: Any, name: str, fallback: float) -> Any:
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(pick(self.temperature, "temperature", 1.0)),
            top_p=float(pick(self.top_p, "top_p", 1.0)),
            top_k=max(int(pick(self.top_k, "top_k", 0)), 0),
            min_p=float(pick(self.min_p, "min_p", 0.0)),
            repetition_penalty=float(pick(self.repetition_penalty, "repetition_penalty", 1.0)),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
            priority=self.priority or 0,
            output_in_prompt=self.output_in_prompt,
        )


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    sampling: Sampling
    stream: bool
    include_usage: bool
    guide: Guide | None = None
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the answer
    kv_transfer_params: Any = None  # a KV hand-off's phase, as sent (server/kv_transfer_fields.py checks it)
    chat_logprobs: bool = False  # logprobs in a chat completion's shape (CHAT_LOGPROBS)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    sampling: Sampling
    stream: bool
    include_usage: bool
    guide: Guide | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: str | None = None  # none, auto, required, or the name of the one function to call
    parallel_tool_calls: bool = True
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the answer
    kv_transfer_params: Any = None  # a KV hand-off's phase, as sent (server/kv_transfer_fields.py checks it)

    @property
    def forced_tool(self) -> bool:
        """The output is a call, made so by a grammar: tool_choice required or a named function."""
        return bool(self.tools) and self.tool_choice not in ("none", "auto")


def sampling(
    body: dict, max_tokens_names: tuple[str, ...], logprobs: int | None = None, echo: bool = False
) -> Sampling:
    # max_tokens 0 is allowed with echo: the prompt's logprobs and nothing generated
    max_tokens, max_tokens_param = max_tokens_field(body, max_tokens_names, allow_zero=echo)
    n = int_in(body, "n", 1, MAX_N) or 1
    best_of = optional_int(body, "best_of")
    if best_of is not None and best_of != n:
        raise invalid(
            f"'best_of' must equal 'n' ({n}) when given: this server returns every choice it generates, got {best_of}",
            "best_of",
            "unsupported_value",
        )
    seed = optional_int(body, "seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise invalid("'seed' must fit in 64 bits", "seed")
    stop_ids = body.get("stop_token_ids")
    min_tokens = optional_int(body, "min_tokens", minimum=0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid(f"'min_tokens' ({min_tokens}) must not exceed '{max_tokens_param}' ({max_tokens})", "min_tokens")
    top_k = optional_int(body, "top_k", minimum=-1)
    return Sampling(
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        temperature=optional_number(body, "temperature", 0.0, 2.0),
        top_p=optional_number(body, "top_p", 0.0, 1.0, low_open=True),
        top_k=None if top_k is None else max(top_k, 0),
        seed=seed,
        stop=stop_strings(body),
        stop_token_ids=() if stop_ids is None else tuple(int_list(stop_ids, "stop_token_ids")),
        ignore_eos=boolean(body, "ignore_eos"),
        n=n,
        min_p=optional_number(body, "min_p", 0.0, 1.0),
        repetition_penalty=optional_number(body, "repetition_penalty", 0.0, math.inf, low_open=True),
        presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=logit_bias(body),
        min_tokens=min_tokens,
        logprobs=logprobs,
        echo=echo,
        priority=optional_int(body, "priority", minimum=-(2**31)),
    )


def header_priority(value: str | None) -> int:
    """The gateway's X-Goodput-Priority header: `online` (0), `batch` (1) or an integer."""
    if value is None or value == "online":
        return 0
    if value == "batch":
        return 1
    try:
        return int(value)
    except ValueError:
        raise invalid(
            f"The header X-Goodput-Priority must be online, batch or an integer, got {shown(value)}",
            "X-Goodput-Priority",
        ) from None


def model_name(body: dict) -> str:
    value = body.get("model")
    if value is None:
        raise missing("model")
    if not isinstance(value, str):
        raise wrong_type("model", "a string")
    return value


def include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise wrong_type("stream_options", "an object")
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise wrong_type("stream_options.include_usage", "a boolean")
    return bool(value)


def parse_completion(body: dict) -> CompletionRequest:
    reject_unsupported(body, {"suffix": ("",), "tools": ([],), "tool_choice": ("none",)})
    stream = boolean(body, "stream")
    echo = boolean(body, "echo")
    logprobs = int_in(body, "logprobs", 0, MAX_LOGPROBS)
    fields = sampling(body, ("max_tokens", "max_completion_tokens"), logprobs, echo)
    output_in_prompt = optional_int(body, RESUME_OUTPUT_IDS, minimum=0) or 0
    chat_logprobs = boolean(body, CHAT_LOGPROBS)
    if chat_logprobs and (logprobs is None or echo):
        raise invalid(
            f"'{CHAT_LOGPROBS}' shapes the logprobs of generated tokens: it needs 'logprobs', and no 'echo'",
            CHAT_LOGPROBS,
        )
    return CompletionRequest(
        model_name(body),
        completion_prompt(body.get("prompt")),
        dataclasses.replace(fields, output_in_prompt=output_in_prompt),
        stream,
        include_usage(body, stream),
        guide(body),
        boolean(body, "return_token_ids"),
        body.get("kv_transfer_params"),
        chat_logprobs,
    )


def completion_prompt(value: Any) -> str | list[int]:
    if value is None:
        raise missing("prompt")
    if isinstance(value, list) and value and not all(is_int(v) for v in value):
        if len(value) > 1:
            raise invalid("Only one prompt per request is supported", "prompt", "unsupported_value")
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise invalid("'prompt' must not be empty", "prompt")
        return value
    if isinstance(value, list) and all(is_int(v) for v in value):
        if not value:
            raise invalid("'prompt' must not be empty", "prompt")
        return value
    raise wrong_type("prompt", "a string or a list of token ids")


def parse_chat(body: dict) -> ChatRequest:
    # a chat prompt is rendered from messages: no ids to name; and its logprobs have the chat shape already
    for name in (RESUME_OUTPUT_IDS, CHAT_LOGPROBS):
        if body.get(name) is not None:
            raise invalid(f"'{name}' is supported on /v1/completions only", name, "unsupported_parameter")
    stream = boolean(body, "stream")
    top_logprobs = int_in(body, "top_logprobs", 0, MAX_LOGPROBS)
    logprobs = None
    if boolean(body, "logprobs"):
        logprobs = top_logprobs or 0
    elif top_logprobs is not None:
        raise invalid("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    tools = tool_list(body.get("tools"))
    choice = tool_choice(body.get("tool_choice"), tools)
    parallel = boolean(body, "parallel_tool_calls", default=True)
    output_guide = guide(body)
    if output_guide is not None and tools and choice not in ("none", "auto"):
        raise invalid(
            f"'{output_guide.param}' cannot be combined with 'tool_choice' {shown(choice)}: the output is a tool call",
            output_guide.param,
        )
    if tools and choice not in ("none", "auto"):
        output_guide = Guide(tool_call_spec(tools, choice, parallel), "tools", "tool_call")
    return ChatRequest(
        model_name(body),
        chat_messages(body.get("messages")),
        sampling(body, ("max_completion_tokens", "max_tokens"), logprobs),
        stream,
        include_usage(body, stream),
        output_guide,
        tools,
        choice,
        parallel,
        boolean(body, "return_token_ids"),
        body.get("kv_transfer_params"),
    )
