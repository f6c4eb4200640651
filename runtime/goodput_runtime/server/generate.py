"""One generation request against the engine, answered whole or as server-sent events."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from goodput_runtime.engine.outputs import (
    EngineStoppedError,
    InvalidPromptError,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
)
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.server.errors import APIError, internal, invalid, queue_full, unavailable
from goodput_runtime.server.responses import Shape, usage

log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Tracker:
    """Request ids the server is answering; shutdown waits on it to drain."""

    def __init__(self) -> None:
        self.active: set[str] = set()

    def __len__(self) -> int:
        return len(self.active)


async def generate(request: web.Request, engine: Any, tracker: Tracker, shape: Shape,
                   prompt_ids: list[int], params: SamplingParams, stream: bool,
                   prompt_param: str) -> web.StreamResponse:
    outputs = admit(engine, shape.id, prompt_ids, params, prompt_param)
    tracker.active.add(shape.id)
    finished = False
    try:
        if stream:
            response, finished = await stream_events(request, shape, outputs)
            return response
        text, last = await collect(outputs)
        finished = True
        counts = usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
        return web.json_response(shape.response(text, last.finish_reason, counts))
    finally:
        if not finished:
            # the client left (or we failed) before the end: free the request's KV blocks now
            engine.abort(shape.id)
            log.info("Aborted request %s before it finished", shape.id)
        tracker.active.discard(shape.id)


def admit(engine: Any, request_id: str, prompt_ids: list[int], params: SamplingParams,
          prompt_param: str) -> AsyncIterator[RequestOutput]:
    try:
        return engine.add_request(request_id, prompt_ids, params)
    except QueueFullError:
        raise queue_full() from None
    except PromptTooLongError as exc:
        raise invalid(str(exc), prompt_param, "context_length_exceeded") from None
    except InvalidPromptError as exc:
        raise invalid(f"'{prompt_param}' cannot be served: {exc}", prompt_param) from None
    except EngineStoppedError:
        raise unavailable("The server is shutting down and accepts no new requests",
                          "shutting_down") from None


async def collect(outputs: AsyncIterator[RequestOutput]) -> tuple[str, RequestOutput]:
    parts: list[str] = []
    last = None
    async for out in outputs:
        parts.append(out.text)
        last = out
        if out.finished:
            break
    if last is None or not last.finished:
        raise RuntimeError("The engine ended a request's stream without a finished output")
    return "".join(parts), last


def event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def stream_events(request: web.Request, shape: Shape,
                        outputs: AsyncIterator[RequestOutput]) -> tuple[web.StreamResponse, bool]:
    """Stream chunks until the engine finishes; report whether it did."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    finished = False
    try:
        for chunk in shape.first_chunks():
            await response.write(event(chunk))
        async for out in outputs:
            if out.text:
                await response.write(event(shape.chunk(out.text)))
            if out.finished:
                finished = True
                await response.write(event(shape.chunk("", out.finish_reason)))
                if shape.include_usage:
                    counts = usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
                    await response.write(event(shape.usage_chunk(counts)))
                break
        if not finished:
            raise RuntimeError("The engine ended a request's stream without a finished output")
    except ConnectionResetError:
        log.info("Client of request %s went away", shape.id)
        return response, finished
    except Exception as exc:  # headers are sent: report in-band, keep serving others
        error = exc if isinstance(exc, APIError) else internal()
        log.exception("Request %s failed mid-stream", shape.id)
        await write_quietly(response, event(error.body()))
    await write_quietly(response, event("[DONE]"))
    try:
        await response.write_eof()
    except ConnectionResetError:
        pass
    return response, finished


async def write_quietly(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError:
        pass
