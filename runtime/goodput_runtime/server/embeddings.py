"""``POST /v1/embeddings``: each input is one request the engine prefills and pools.

An input goes through the same scheduler as a completion (chunked prefill, sharing steps with
generation); on its last chunk the model runner pools the final hidden states (after the model's
last norm) instead of sampling, and the request finishes. Pooling is the server's (`--pooling`);
vectors are L2-normalized unless the request sends ``"normalize": false``.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import sys
import uuid
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from goodput_runtime.engine.outputs import RequestOutput
from goodput_runtime.engine.sequence import PoolingParams
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.server.errors import internal, invalid, missing, unavailable, wrong_type
from goodput_runtime.server.generate import admit
from goodput_runtime.server.prompts import completion_prompt_ids
from goodput_runtime.server.protocol import (
    boolean,
    header_priority,
    is_int,
    model_name,
    optional_int,
    parse_json,
    reject_unknown,
    shown,
)
from goodput_runtime.server.state import ServerState

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
ENCODINGS = ("float", "base64")
FIELDS = frozenset(
    {"model", "input", "encoding_format", "dimensions", "user", "normalize", "add_special_tokens", "priority"}
)
EMBEDDING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)  # never used to sample: nothing is generated


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str
    inputs: list[str | list[int]]
    encoding_format: str
    dimensions: int | None
    normalize: bool
    add_special_tokens: bool
    single: bool  # one input, not a list of them: errors name 'input' rather than 'input[0]'
    priority: int | None = None  # as in a completion request: None, the header's


def parse_embedding(body: dict) -> EmbeddingRequest:
    reject_unknown(body, FIELDS)
    model = model_name(body)
    raw = body.get("input")
    inputs = embedding_inputs(raw)
    single = isinstance(raw, str) or (isinstance(raw, list) and all(is_int(v) for v in raw))
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise invalid(f"'encoding_format' must be float or base64, got {shown(encoding)}", "encoding_format")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise wrong_type("user", "a string")
    return EmbeddingRequest(
        model,
        inputs,
        encoding,
        optional_int(body, "dimensions", minimum=1),
        boolean(body, "normalize", True),
        boolean(body, "add_special_tokens", True),
        single,
        optional_int(body, "priority"),
    )


def embedding_inputs(value: Any) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if value is None:
        raise missing("input")
    single = isinstance(value, str) or (isinstance(value, list) and value and all(is_int(v) for v in value))
    if single:
        value = [value]
    if not isinstance(value, list):
        raise wrong_type("input", "a string, a list of strings, or token ids")
    if not value:
        raise invalid("'input' must not be empty", "input")
    if len(value) > MAX_INPUTS:
        raise invalid(f"'input' holds {len(value)} inputs; at most {MAX_INPUTS} are allowed", "input")
    for i, item in enumerate(value):
        param = "input" if single else f"input[{i}]"
        is_ids = isinstance(item, list) and all(is_int(v) for v in item)
        if not (isinstance(item, str) or is_ids):
            raise wrong_type(param, "a string or a list of token ids")
        if not item:
            raise invalid(f"'{param}' must not be empty", param)
    return value


def encode(vector: list[float], encoding: str) -> list[float] | str:
    """float: the numbers; base64: their little-endian float32 bytes, as OpenAI sends them."""
    if encoding == "float":
        return vector
    packed = array("f", vector)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


async def final_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    async for out in outputs:
        if out.finished:
            return out
    raise RuntimeError("The engine ended a request's stream without a finished output")


async def embeddings(request: web.Request, state: ServerState) -> web.Response:
    """The route's work."""
    body = parse_embedding(parse_json(await request.read()))
    engine = state.serving_engine()
    adapter = await state.resolve_model(body.model)
    size = engine.embedding_size
    if body.dimensions is not None and body.dimensions != size:
        raise invalid(
            f"'dimensions' must be {size} (this model's embedding size) when given: the model is not "
            f"trained for shorter embeddings, so they are not offered",
            "dimensions",
            "unsupported_value",
        )
    prompts = []
    for i, item in enumerate(body.inputs):
        param = "input" if body.single else f"input[{i}]"
        ids = completion_prompt_ids(engine.tokenizer, item, param, body.add_special_tokens)
        if not ids:
            raise invalid(f"'{param}' holds no tokens", param)
        if len(ids) > engine.max_model_len:
            raise invalid(
                f"This model's maximum context length is {engine.max_model_len} tokens, but '{param}' "
                f"holds {len(ids)} tokens. Shorten it.",
                param,
                "context_length_exceeded",
            )
        prompts.append(ids)
    pooling = PoolingParams(engine.pooling, body.normalize)
    priority = body.priority
    if priority is None:
        priority = header_priority(request.headers.get("X-Goodput-Priority"))
    params = dataclasses.replace(EMBEDDING_PARAMS, priority=priority, lora=adapter)
    base = f"embd-{uuid.uuid4().hex}"
    request_ids: list[str] = []
    finished = False
    try:
        streams = []
        for i, ids in enumerate(prompts):
            streams.append(admit(engine, f"{base}-{i}", ids, params, "input", pooling))
            request_ids.append(f"{base}-{i}")
            state.tracker.active.add(request_ids[-1])
        outputs = await asyncio.gather(*(final_output(s) for s in streams))
        finished = True
    finally:
        for request_id in request_ids:
            if not finished:  # the client left, or an input was refused: free what was admitted
                engine.abort(request_id)
            state.tracker.active.discard(request_id)
    data = []
    for i, out in enumerate(outputs):
        if out.embedding is None:
            if out.finish_reason == "abort":
                raise unavailable("The server shut down before the embeddings were computed", "shutting_down")
            raise internal()
        data.append({"object": "embedding", "index": i, "embedding": encode(out.embedding, body.encoding_format)})
    tokens = sum(len(ids) for ids in prompts)
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )
