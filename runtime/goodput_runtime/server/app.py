"""The OpenAI-compatible HTTP application: routes, readiness, and errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import hdrs, web

from goodput_runtime.engine.client import EngineClient
from goodput_runtime.engine.outputs import TokenLogprob
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.server import debug, kv_events_routes, lora_routes
from goodput_runtime.server import embeddings as embedding_routes
from goodput_runtime.server import tokens as token_routes
from goodput_runtime.server.auth import require_api_key
from goodput_runtime.server.errors import APIError, from_http_exception, internal, invalid
from goodput_runtime.server.generate import generate
from goodput_runtime.server.kv_transfer_fields import parse_kv_transfer
from goodput_runtime.server.prompts import (
    chat_prompt_ids,
    check_token_ids,
    completion_prompt_ids,
    token_budget,
)
from goodput_runtime.server.protocol import (
    CHAT_LOGPROBS_HEADER,
    RESUME_GRAMMAR_HEADER,
    RESUME_OUTPUT_IDS,
    RESUME_OUTPUT_IDS_HEADER,
    Guide,
    Sampling,
    header_priority,
    parse_chat,
    parse_completion,
    parse_json,
)
from goodput_runtime.server.request_slo import request_slo, with_slo
from goodput_runtime.server.responses import ChatShape, CompletionShape
from goodput_runtime.server.state import STATE, ServerState
from goodput_runtime.structured.resumed import advanced

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        log.debug("Refused %s %s: %s", request.method, request.path, exc.message)
        if exc.status == 429:
            request.app[STATE].metrics.record_rejected(exc.code)
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return from_http_exception(exc).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("Unexpected error serving %s %s", request.method, request.path)
        return internal().response()


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = parse_completion(parse_json(await request.read()))
    engine = state.serving_engine()
    adapter = await state.resolve_model(body.model)
    prompt_ids = completion_prompt_ids(engine.tokenizer, body.prompt)
    params = sampling_params(engine, body.sampling, len(prompt_ids), "prompt")
    params = with_priority(request, body.sampling, dataclasses.replace(params, lora=adapter))
    kv = parse_kv_transfer(body.kv_transfer_params, engine, params, body.stream)
    predicted = state.admit(engine, prompt_ids, params, kv.remote_tokens if kv is not None else 0)
    if params.output_in_prompt:  # the answer says it took them (protocol.py)
        predicted = {**predicted, RESUME_OUTPUT_IDS_HEADER: str(params.output_in_prompt)}
    params = await state.grammars.params(engine, body.guide, params)
    if params.output_in_prompt and body.guide is not None:
        params = await resumed_grammar(state, params, prompt_ids, body.guide)
        predicted = {**predicted, RESUME_GRAMMAR_HEADER: str(params.output_in_prompt)}
    shape_of = ChatLogprobsShape if body.chat_logprobs else CompletionShape
    shape = shape_of(
        body.model, body.include_usage, n=params.n, token_text=state.token_text, return_token_ids=body.return_token_ids
    )
    if body.chat_logprobs:
        predicted = {**predicted, CHAT_LOGPROBS_HEADER: "true"}
    echo_text = None
    if body.sampling.echo:
        decoded = body.prompt if isinstance(body.prompt, str) else engine.tokenizer.decode(prompt_ids)
        assert isinstance(decoded, str)  # one sequence decodes to one string
        echo_text = decoded
    return await generate(
        request,
        engine,
        state.tracker,
        shape,
        prompt_ids,
        params,
        body.stream,
        "prompt",
        echo_text,
        headers=predicted,
        kv=kv,
    )


@dataclass
class ChatLogprobsShape(CompletionShape):
    """A completion whose logprobs come in a chat completion's shape (`chat_logprobs`)."""

    chat: ChatShape | None = None

    def logprobs(self, index: int, entries: list[tuple[int, TokenLogprob | None]], text: str) -> dict | None:
        if self.chat is None:
            self.chat = ChatShape(self.model, id=self.id, token_text=self.token_text)
        return self.chat.logprobs(index, entries, text)


async def resumed_grammar(
    state: ServerState, params: SamplingParams, prompt_ids: list[int], guide: Guide
) -> SamplingParams:
    """params whose grammar goes on from the request's earlier output, the prompt's last ids
    (`resume_output_ids`), advanced on the grammars' thread (never on the event loop); a 400 naming the
    field where the grammar does not accept them."""
    earlier = prompt_ids[len(prompt_ids) - params.output_in_prompt :]
    loop = asyncio.get_running_loop()
    grammar = await loop.run_in_executor(state.grammars.executor, advanced, params.grammar, earlier)
    if grammar is None:
        raise invalid(
            f"'{RESUME_OUTPUT_IDS}' names {len(earlier)} ids of earlier output that '{guide.param}' does not accept",
            RESUME_OUTPUT_IDS,
        )
    return dataclasses.replace(params, grammar=grammar)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = parse_chat(parse_json(await request.read()))
    engine = state.serving_engine()
    adapter = await state.resolve_model(body.model)
    tools = state.grammars.tools(engine, body)
    prompt_ids = chat_prompt_ids(
        engine.tokenizer,
        body.messages,
        state.model_name,
        tools=[t.raw for t in body.tools] if tools is not None else None,
    )
    params = sampling_params(engine, body.sampling, len(prompt_ids), "messages")
    params = with_priority(request, body.sampling, dataclasses.replace(params, lora=adapter))
    kv = parse_kv_transfer(body.kv_transfer_params, engine, params, body.stream)
    predicted = state.admit(engine, prompt_ids, params, kv.remote_tokens if kv is not None else 0)
    params = await state.grammars.params(engine, body.guide, params)
    shape = ChatShape(
        body.model, body.include_usage, n=params.n, token_text=state.token_text, return_token_ids=body.return_token_ids
    )
    return await generate(
        request,
        engine,
        state.tracker,
        shape,
        prompt_ids,
        params,
        body.stream,
        "messages",
        tools=tools,
        count_calls=state.metrics.record_tool_calls,
        headers=predicted,
        kv=kv,
    )


async def embeddings(request: web.Request) -> web.Response:
    return await embedding_routes.embeddings(request, request.app[STATE])


async def debug_state(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(debug.state_of(state.engine, state.phase, len(state.tracker)))


async def tokenize(request: web.Request) -> web.Response:
    return await token_routes.tokenize(request, request.app[STATE])


async def detokenize(request: web.Request) -> web.Response:
    return await token_routes.detokenize(request, request.app[STATE])


def sampling_params(
    engine: EngineClient, sampling: Sampling, num_prompt_tokens: int, prompt_param: str
) -> SamplingParams:
    """The engine's settings for a request: its limit within the context (the model's default
    max_tokens where it is silent), and the model's generation_config defaults where it is silent."""
    defaults = engine.sampling_defaults
    max_tokens = token_budget(sampling, num_prompt_tokens, engine.max_model_len, prompt_param)
    if sampling.max_tokens is None and "max_tokens" in defaults:
        max_tokens = max(1, min(max_tokens, int(defaults["max_tokens"])))
    if sampling.min_tokens > max_tokens:
        raise invalid(
            f"'min_tokens' ({sampling.min_tokens}) exceeds the {max_tokens} tokens this request may generate",
            "min_tokens",
        )
    check_token_ids(engine.tokenizer, sampling)
    if sampling.output_in_prompt > num_prompt_tokens:
        raise invalid(
            f"'{RESUME_OUTPUT_IDS}' ({sampling.output_in_prompt}) exceeds the prompt's {num_prompt_tokens} tokens",
            RESUME_OUTPUT_IDS,
        )
    return sampling.params(max_tokens, defaults)


def with_priority(request: web.Request, sampling: Sampling, params: SamplingParams) -> SamplingParams:
    """The body's `priority`, else the gateway's header (batch lines carry it); and the request's own SLO
    targets from its headers (request_slo.py), which admission and its goodput are judged by."""
    params = with_slo(params, request_slo(request.headers))
    if sampling.priority is not None:
        return params
    return dataclasses.replace(params, priority=header_priority(request.headers.get("X-Goodput-Priority")))


def model_card(state: ServerState) -> dict:
    card = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "goodput",
        "root": state.root,
        "parent": None,
    }
    if state.engine is not None:
        card["max_model_len"] = state.engine.max_model_len
    return card


def adapter_cards(state: ServerState) -> list[dict]:
    """vLLM's cards of the LoRA adapters: each with the base model as its parent, its directory as root."""
    adapters = state.engine.lora if state.engine is not None else None
    if adapters is None:
        return []
    cards = []
    for name in adapters.names():
        adapter = adapters.by_name[name]
        cards.append(
            {
                "id": name,
                "object": "model",
                "created": int(adapter.loaded_at),
                "owned_by": "goodput",
                "root": adapter.path,
                "parent": state.model_name,
                "max_model_len": state.engine.max_model_len if state.engine is not None else None,
            }
        )
    return cards


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [model_card(state), *adapter_cards(state)]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    wanted = request.match_info["model"]
    for card in [model_card(state), *adapter_cards(state)]:
        if card["id"] == wanted:
            return web.json_response(card)
    raise APIError(404, f"The model '{wanted}' does not exist", param="model", code="model_not_found")


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    phase = state.phase
    if phase == "ready" and state.engine is not None and not state.engine.alive:
        phase = "engine stopped"  # the step loop is gone: let the kubelet restart the pod
    return web.json_response({"status": phase}, status=200 if phase == "ready" else 503)


async def close_connections_when_stopping(request: web.Request, response: web.StreamResponse) -> None:
    """``Connection: close`` once stopping, so keep-alive clients reconnect and land on another pod."""
    if request.app[STATE].closing:
        response.force_close()  # the server closes the connection after this response
        response.headers[hdrs.CONNECTION] = "close"  # headers are already computed: say so explicitly


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": content_type})


def build_app(state: ServerState) -> web.Application:
    middlewares = [openai_errors, require_api_key(state.api_keys)] if state.api_keys else [openai_errors]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app.on_response_prepare.append(close_connections_when_stopping)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/state", debug_state)
    kv_events_routes.add_routes(app)
    if state.allow_lora_updates:
        lora_routes.add_routes(app)
    return app
