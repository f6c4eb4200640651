"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes.

/tokenize takes ``{"model"?, "prompt", "add_special_tokens"?}`` or ``{"model"?, "messages",
"add_generation_prompt"?, "continue_final_message"?, "add_special_tokens"?}`` (messages go through the
chat template exactly as /v1/chat/completions sends them) and answers ``{"count", "max_model_len",
"tokens", "token_strs"}``; /detokenize takes ``{"model"?, "tokens"}`` and answers ``{"prompt"}``.
"""

from __future__ import annotations

from aiohttp import web

from goodput_runtime.server.errors import invalid, missing, wrong_type
from goodput_runtime.server.prompts import chat_prompt_ids, check_vocabulary
from goodput_runtime.server.protocol import boolean, chat_messages, int_list, parse_json, reject_unknown
from goodput_runtime.server.state import ServerState

PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
CHAT_FIELDS = frozenset(
    {"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "return_token_strs"}
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def check_model(state: ServerState, body: dict) -> None:
    """vLLM lets these requests leave out the model; one that names it must name this one."""
    value = body.get("model")
    if value is None:
        return
    if not isinstance(value, str):
        raise wrong_type("model", "a string")
    state.check_model(value)


async def tokenize(request: web.Request, state: ServerState) -> web.Response:
    """The route's work."""
    body = parse_json(await request.read())
    if "messages" in body and "prompt" in body:
        raise invalid("Send 'prompt' or 'messages', not both", "messages")
    is_chat = "messages" in body
    reject_unknown(body, CHAT_FIELDS if is_chat else PROMPT_FIELDS)
    check_model(state, body)
    want_strs = boolean(body, "return_token_strs")
    engine = state.serving_engine()
    tokenizer = engine.tokenizer
    if is_chat:
        messages = chat_messages(body.get("messages"))
        generation_prompt = boolean(body, "add_generation_prompt", True)
        continue_final = boolean(body, "continue_final_message")
        if generation_prompt and continue_final:
            raise invalid(
                "'continue_final_message' continues the last message, so it needs 'add_generation_prompt' set to false",
                "continue_final_message",
            )
        if continue_final and messages[-1]["role"] != "assistant":
            raise invalid(
                "'continue_final_message' needs the last message to be the assistant's", "continue_final_message"
            )
        tokens = chat_prompt_ids(
            tokenizer,
            messages,
            state.model_name,
            generation_prompt,
            continue_final,
            boolean(body, "add_special_tokens"),
        )
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise missing("prompt")
        if not isinstance(prompt, str):
            raise wrong_type("prompt", "a string")
        tokens = list(tokenizer(prompt, add_special_tokens=boolean(body, "add_special_tokens", True)).input_ids)
    return web.json_response(
        {
            "count": len(tokens),
            "max_model_len": engine.max_model_len,
            "tokens": tokens,
            "token_strs": tokenizer.convert_ids_to_tokens(tokens) if want_strs else None,
        }
    )


async def detokenize(request: web.Request, state: ServerState) -> web.Response:
    """The route's work."""
    body = parse_json(await request.read())
    reject_unknown(body, DETOKENIZE_FIELDS)
    check_model(state, body)
    if body.get("tokens") is None:
        raise missing("tokens")
    tokens = int_list(body["tokens"], "tokens")
    engine = state.serving_engine()
    check_vocabulary(engine.tokenizer, tokens, "tokens")
    return web.json_response({"prompt": engine.tokenizer.decode(tokens)})
