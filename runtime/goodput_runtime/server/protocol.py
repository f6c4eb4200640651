"""Validation of OpenAI request bodies into plain dataclasses; every error names its field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from goodput_runtime.sampling import MAX_LOGPROBS, MAX_N, SamplingParams
from goodput_runtime.server.errors import invalid, missing, wrong_type
from goodput_runtime.structured.grammar import GrammarError, GrammarSpec
from goodput_runtime.structured.schema import check_schema

ROLES = ("system", "developer", "user", "assistant", "tool")
SEED_RANGE = (-(2**63), 2**64 - 1)


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
        )


@dataclass(frozen=True, slots=True)
class Guide:
    """The grammar a request's output must follow, and the field that asked for it."""

    spec: GrammarSpec
    param: str  # named by the 400 when the engine cannot compile it
    kind: str  # json_object, json_schema, regex, choice, grammar or tool_call (the metric's label)


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # a JSON Schema for the arguments object
    raw: dict  # as sent, for the chat template


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


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"The request body is not valid JSON: {exc}", None, "invalid_json") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise invalid(
            "The request body is not valid JSON: its arrays and objects nest too deeply", None, "invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object", None, "invalid_json")
    return body


def shown(value: Any, limit: int = 60) -> str:
    """A client's value as an error message quotes it: a scalar's repr, cut short; a container's kind
    alone (a deeply nested one has no repr within the interpreter's recursion limit)."""
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def optional_int(body: dict, name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise wrong_type(name, "an integer")
    if minimum is not None and value < minimum:
        raise invalid(f"'{name}' must be at least {minimum}, got {value}", name)
    return value


def number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = optional_number(body, name, low, high, low_open)
    return default if value is None else value


def optional_number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_number(value) or not math.isfinite(value):
        raise wrong_type(name, "a finite number")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(f"'{name}' must be in {bracket}{low}, {high}], got {value}", name)
    return float(value)


def int_in(body: dict, name: str, low: int, high: int) -> int | None:
    value = optional_int(body, name)
    if value is not None and not low <= value <= high:
        raise invalid(f"'{name}' must be between {low} and {high}, got {value}", name)
    return value


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise wrong_type(name, "a boolean")
    return value


def int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(is_int(v) for v in value):
        raise wrong_type(name, "a list of integers")
    return value


def stop_strings(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise wrong_type("stop", "a string or a list of strings")
    return tuple(v for v in value if v)


def reject_unknown(body: dict, known: frozenset[str]) -> None:
    """Every field outside `known` is refused, naming it: none is accepted and ignored."""
    for name in body:
        if name not in known:
            raise invalid(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def reject_unsupported(body: dict, names: dict[str, Any]) -> None:
    """Fields we do not implement are refused unless they hold their do-nothing value."""
    for name, harmless in names.items():
        value = body.get(name)
        if value is not None and value not in harmless:
            raise invalid(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """{"token id": bias}; each bias clamped to [-100, 100] as OpenAI and vLLM do."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise wrong_type("logit_bias", "an object mapping token ids to numbers")
    pairs = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise invalid(f"'logit_bias' keys must be token ids, got {shown(key)}", "logit_bias") from None
        if not is_number(bias) or not math.isfinite(bias):
            raise invalid(f"'logit_bias' values must be numbers, got {shown(bias)} for {shown(key)}", "logit_bias")
        pairs.append((token, max(-100.0, min(100.0, float(bias)))))
    return tuple(pairs)


def max_tokens_field(body: dict, names: tuple[str, ...], allow_zero: bool) -> tuple[int | None, str]:
    """The output limit under any of its names; two names with different values are refused."""
    given = [(name, value) for name in names if (value := optional_int(body, name)) is not None]
    if len({value for _, value in given}) > 1:
        raise invalid(
            f"'max_completion_tokens' and 'max_tokens' name the same limit and differ "
            f"({body['max_completion_tokens']} and {body['max_tokens']}); send one",
            "max_completion_tokens",
        )
    if not given:
        return None, names[0]
    name, value = given[0]
    if value < 0 or (value == 0 and not allow_zero):
        least = "0" if allow_zero else "1"
        raise invalid(f"'{name}' must be at least {least}, got {value}", name)
    return value, name


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
    return CompletionRequest(
        model_name(body),
        completion_prompt(body.get("prompt")),
        sampling(body, ("max_tokens", "max_completion_tokens"), logprobs, echo),
        stream,
        include_usage(body, stream),
        guide(body),
        boolean(body, "return_token_ids"),
        body.get("kv_transfer_params"),
    )


GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guide(body: dict) -> Guide | None:
    """The grammar asked for by response_format or one of vLLM's guided_* fields (at most one of them)."""
    given = [
        name
        for name in GUIDED_FIELDS
        if body.get(name) is not None
        and not (name == "response_format" and isinstance(body[name], dict) and body[name].get("type") == "text")
    ]
    if len(given) > 1:
        raise invalid(f"'{given[0]}' and '{given[1]}' both constrain the output; send one", given[1])
    if not given:
        if body.get("response_format") is not None:
            response_format(body["response_format"])  # checks {"type": "text"} has nothing else wrong
        return None
    name = given[0]
    value = body[name]
    if name == "response_format":
        return response_format(value)
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise invalid("'guided_json' must be a JSON Schema (an object or its JSON text)", name) from None
        return Guide(schema_spec(value, name), name, "json_schema")
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise wrong_type(name, "a non-empty string (a regular expression)")
        return Guide(GrammarSpec("regex", value), name, "regex")
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise wrong_type(name, "a non-empty list of non-empty strings")
        return Guide(GrammarSpec("choice", json.dumps(value)), name, "choice")
    if not isinstance(value, str) or not value.strip():
        raise wrong_type(name, "a non-empty string (an EBNF or Lark grammar)")
    return Guide(GrammarSpec("grammar", value), name, "grammar")


def response_format(value: Any) -> Guide | None:
    if not isinstance(value, dict):
        raise wrong_type("response_format", "an object")
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid(
            f"'response_format.type' must be one of text, json_object, json_schema, got {shown(kind)}",
            "response_format.type",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide(GrammarSpec("json_object"), "response_format", "json_object")
    spec = value.get("json_schema")
    if spec is None:
        raise missing("response_format.json_schema")
    if not isinstance(spec, dict):
        raise wrong_type("response_format.json_schema", "an object")
    name = spec.get("name")
    if name is None:
        raise missing("response_format.json_schema.name")
    if not isinstance(name, str):
        raise wrong_type("response_format.json_schema.name", "a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise wrong_type("response_format.json_schema.strict", "a boolean")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise wrong_type("response_format.json_schema.description", "a string")
    # strict or not, the schema is enforced: a grammar can only make outputs more conformant
    schema = spec.get("schema")
    if schema is None:
        return Guide(GrammarSpec("json_object"), "response_format.json_schema", "json_schema")
    param = "response_format.json_schema.schema"
    return Guide(schema_spec(schema, param), param, "json_schema")


def schema_spec(schema: Any, param: str) -> GrammarSpec:
    try:
        check_schema(schema)
    except GrammarError as exc:
        raise invalid(f"'{param}' cannot be enforced: {exc}", param, "unsupported_schema") from None
    return GrammarSpec.json_schema(schema)


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


def tool_list(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise wrong_type("tools", "a list of tool objects")
    tools: list[Tool] = []
    for i, item in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(where, "an object")
        if item.get("type") != "function":
            raise invalid(f"'{where}.type' must be 'function', got {shown(item.get('type'))}", f"{where}.type")
        function = item.get("function")
        if not isinstance(function, dict):
            raise wrong_type(f"{where}.function", "an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise wrong_type(f"{where}.function.name", "a non-empty string")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise wrong_type(f"{where}.function.description", "a string")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        schema_spec(parameters, f"{where}.function.parameters")
        if any(t.name == name for t in tools):
            raise invalid(f"'{where}.function.name' repeats the tool name {shown(name)}", f"{where}.function.name")
        tools.append(Tool(name, description, parameters, item))
    return tuple(tools)


def tool_choice(value: Any, tools: tuple[Tool, ...]) -> str:
    if value is None:
        return "auto" if tools else "none"
    if not tools and value != "none":
        raise invalid("'tool_choice' needs 'tools'", "tool_choice")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise invalid(
                f"'tool_choice' must be none, auto, required or a function object, got {shown(value)}", "tool_choice"
            )
        return value
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise wrong_type("tool_choice", 'none, auto, required or {"type": "function", "function": {"name": ...}}')
    name = value["function"].get("name")
    if not any(t.name == name for t in tools):
        raise invalid(
            f"'tool_choice.function.name' names no tool in 'tools': {shown(name)}", "tool_choice.function.name"
        )
    return name


def tool_call_spec(tools: tuple[Tool, ...], choice: str, parallel: bool) -> GrammarSpec:
    """The grammar of a forced call, as vLLM forces one: a named function's output is its arguments
    object; a required call is a JSON array of {"name", "parameters"} objects, one at least."""
    if choice != "required":
        return GrammarSpec.json_schema(next(t.parameters for t in tools if t.name == choice))
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t.name]}, "parameters": t.parameters},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if not parallel:
        schema["maxItems"] = 1
    return GrammarSpec.json_schema(schema)


def chat_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise missing("messages")
    if not isinstance(value, list):
        raise wrong_type("messages", "a list of message objects")
    if not value:
        raise invalid("'messages' must not be empty", "messages")
    return [chat_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def chat_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise wrong_type(where, "an object")
    role = message.get("role")
    if role is None:
        raise missing(f"{where}.role")
    if role not in ROLES:
        raise invalid(f"'{where}.role' must be one of {', '.join(ROLES)}, got {shown(role)}", f"{where}.role")
    parsed: dict[str, Any] = {
        "role": role,
        "content": message_content(message.get("content"), role, f"{where}.content"),
    }
    if role == "assistant" and message.get("tool_calls") is not None:
        parsed["tool_calls"] = message_tool_calls(message["tool_calls"], f"{where}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is None:
            raise missing(f"{where}.tool_call_id")
        if not isinstance(call_id, str):
            raise wrong_type(f"{where}.tool_call_id", "a string")
        parsed["tool_call_id"] = call_id
    if isinstance(message.get("name"), str):
        parsed["name"] = message["name"]
    return parsed


def message_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's earlier calls, their arguments as objects (as chat templates expect them)."""
    if not isinstance(value, list):
        raise wrong_type(where, "a list of tool calls")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise wrong_type(at, "an object with function.name and function.arguments")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                raise invalid(
                    f"'{at}.function.arguments' must be a JSON object's text", f"{at}.function.arguments"
                ) from None
        if not isinstance(arguments, dict):
            raise wrong_type(f"{at}.function.arguments", "a JSON object's text")
        calls.append(
            {
                "id": call.get("id") if isinstance(call.get("id"), str) else f"call_{i}",
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def message_content(content: Any, role: str, where: str) -> str:
    if content is None:
        if role == "assistant":
            return ""
        raise missing(where)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            is_text = isinstance(part, dict) and part.get("type") == "text"
            if not (is_text and isinstance(part.get("text"), str)):
                raise invalid(
                    f"'{where}[{i}]' must be a text part: only text content is supported",
                    f"{where}[{i}]",
                    "unsupported_value",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise wrong_type(where, "a string or a list of text parts")
