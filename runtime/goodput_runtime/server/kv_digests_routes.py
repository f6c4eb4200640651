"""``POST /kv/digests``: a prompt's prefix-block digests, as this runtime would key its KV blocks.

A router that does not hold the model's tokenizer sends the body it is about to send to
``/v1/completions`` or ``/v1/chat/completions`` (``?api=completions`` or ``?api=chat``; by default
``chat`` where the body has ``messages``). The runtime parses it as that route does, renders and
tokenizes the prompt exactly as generation would (the chat template, the tools), salts the chain as
the engine salts it (the model's identity and the LoRA adapter the request names), and answers::

    {"block_size": 16, "num_tokens": 1011, "digests": ["a1b2…", …]}

one 32-hex digest (engine/prefix_digest.py, as ``GET /kv/events`` names blocks) per full block of
the prompt, in order. It takes no engine step: the work is the tokenizer's and one BLAKE2b per block.
A request this runtime would refuse is refused here the same way (a 4xx naming the cause); an
adapter that is not loaded here is a 404 (its weights' digest is part of the salt).
"""

from __future__ import annotations

from aiohttp import web

from goodput_runtime.engine import prefix_digest
from goodput_runtime.engine.kv_events import hex_digest
from goodput_runtime.server.errors import APIError, invalid
from goodput_runtime.server.prompts import chat_prompt_ids, completion_prompt_ids
from goodput_runtime.server.protocol import parse_chat, parse_completion, parse_json
from goodput_runtime.server.state import STATE

APIS = ("chat", "completions")


def digests_of(token_ids: list[int], block_size: int, root: int) -> list[str]:
    """The digest of each full block of `token_ids`, chained from `root`."""
    out = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = prefix_digest.block_digest(parent, token_ids[start : start + block_size])
        out.append(hex_digest(parent))
    return out


async def kv_digests(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = parse_json(await request.read())
    api = request.query.get("api") or ("chat" if "messages" in body else "completions")
    if api not in APIS:
        raise invalid(f"api={api!r}: expected one of {', '.join(APIS)}", "api")
    engine = state.serving_engine()
    manager = engine.scheduler.block_manager
    if not manager.enable_prefix_caching:
        raise APIError(404, "this runtime keeps no prefix cache: prefix caching is off", code="not_found")
    if api == "chat":
        chat = parse_chat(body)
        adapter = state.check_model(chat.model)
        tools = state.grammars.tools(engine, chat)
        token_ids = chat_prompt_ids(
            engine.tokenizer,
            chat.messages,
            state.model_name,
            tools=[t.raw for t in chat.tools] if tools is not None else None,
        )
    else:
        completion = parse_completion(body)
        adapter = state.check_model(completion.model)
        token_ids = completion_prompt_ids(engine.tokenizer, completion.prompt)
    salt = ""
    if adapter is not None:
        if engine.lora is None or adapter not in engine.lora.by_name:
            raise APIError(404, f"The adapter '{adapter}' is not loaded here", param="model", code="model_not_found")
        salt = engine.lora.get(adapter).key
    root = prefix_digest.root(f"{manager.model_salt}\0{salt}")  # as BlockManager.root salts a sequence
    return web.json_response(
        {
            "block_size": manager.block_size,
            "num_tokens": len(token_ids),
            "digests": digests_of(token_ids, manager.block_size, root),
        }
    )


def add_routes(app: web.Application) -> None:
    app.router.add_post("/kv/digests", kv_digests)
