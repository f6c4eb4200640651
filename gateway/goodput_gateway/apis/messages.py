"""Anthropic's Messages API (`POST /v1/messages`) on the runtime's chat completions.

`system` becomes the system message; `messages` the conversation (text blocks, the assistant's `tool_use`
blocks as its tool calls, the user's `tool_result` blocks as tool turns); `tools` and `tool_choice` the
runtime's tool calls; `max_tokens` (required), `temperature`, `top_p` and `top_k` its sampling. The
answer comes back as a message with `text` and `tool_use` blocks, whole or streamed as Anthropic's
events, and errors in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``).

`stop_sequences` are matched here, on the text as it comes (a sequence split across chunks included),
so the answer can name the one that ended it: the matched text is cut, the replica's stream closed (the
runtime aborts the request), and its usage counted from the tokens received (their ids, asked for with
`return_token_ids`) and the prompt's tokens (the runtime's `/tokenize`, which counts the conversation
without the tool definitions). Such a stream is resumed on another replica as any other (resume.py): the
ids after a resume are those of tokens the client had not had, so the count holds.
Every other field is refused with a 400 naming it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from goodput_gateway.apis import chat
from goodput_gateway.apis.message_answer import Answer, Stopped, with_stops
from goodput_gateway.apis.message_request import MessagesError, bad, translate
from goodput_gateway.errors import APIError
from goodput_gateway.proxy import parse_body

ChatOpener = Callable[..., Any]  # (request, model, body[, path]) -> an async context manager of an Upstream


def sse(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, separators=(',', ':'))}\n\n".encode()


class MessagesAPI:
    def __init__(self, open_chat: ChatOpener) -> None:
        self.open_chat = open_chat

    async def create(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._create(request)
        except APIError as err:  # the gateway's own errors (routing, keys, holding)
            return MessagesError(err.status, err.message, err.retry_after, err.headers).response()
        except MessagesError as err:
            return err.response()

    async def _create(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_body(await request.read())
        except APIError as err:
            raise bad(err.message) from None
        chat_body, stops = translate(body)
        model = body["model"]
        message_id = f"msg_{secrets.token_hex(12)}"
        answer = Answer()
        out: web.StreamResponse | None = None
        async with self.open_chat(request, model, chat_body) as upstream:
            if upstream.status != 200:
                failure = await chat.error_body(upstream)
                raise MessagesError(upstream.status, str(failure.get("message")))
            events = with_stops(chat.events(upstream), stops)
            if body.get("stream"):
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await out.prepare(request)
                start = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": []}
                start |= {"stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
                await out.write(sse("message_start", {"message": start}))
                await self.stream(out, events, answer)
            else:
                async for event in events:
                    answer.add(event)
        if answer.stop_sequence is not None:  # cut here: the runtime never sent its usage
            answer.usage = chat.Usage(await self.prompt_tokens(request, model, chat_body), answer.tokens)
        if out is not None:
            if answer.failed is not None:
                error = {"type": "api_error", "message": answer.failed.message}
                await out.write(sse("error", {"error": error}))
            else:
                delta = {"stop_reason": answer.stop_reason, "stop_sequence": answer.stop_sequence}
                await out.write(sse("message_delta", {"delta": delta, "usage": answer.usage_object()}))
                await out.write(sse("message_stop", {}))
            await out.write_eof()
            return out
        if answer.failed is not None:
            raise MessagesError(500, answer.failed.message)
        return web.json_response(
            {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": answer.content(),
                "stop_reason": answer.stop_reason,
                "stop_sequence": answer.stop_sequence,
                "usage": answer.usage_object(),
            }
        )

    async def stream(
        self, out: web.StreamResponse, events: AsyncIterator[chat.Event | Stopped], answer: Answer
    ) -> None:
        index = -1
        open_kind: str | None = None

        async def close() -> None:
            nonlocal open_kind
            if open_kind is not None:
                await out.write(sse("content_block_stop", {"index": index}))
                open_kind = None

        async for event in events:
            answer.add(event)
            if isinstance(event, chat.Text):
                if open_kind != "text":
                    await close()
                    index, open_kind = index + 1, "text"
                    await out.write(
                        sse("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                    )
                await out.write(
                    sse("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": event.text}})
                )
            elif isinstance(event, chat.ToolStart):
                await close()
                index, open_kind = index + 1, "tool_use"
                block = {"type": "tool_use", "id": event.call_id, "name": event.name, "input": {}}
                await out.write(sse("content_block_start", {"index": index, "content_block": block}))
            elif isinstance(event, chat.ToolArgs) and open_kind == "tool_use":
                delta = {"type": "input_json_delta", "partial_json": event.delta}
                await out.write(sse("content_block_delta", {"index": index, "delta": delta}))
        await close()

    async def prompt_tokens(self, request: web.Request, model: str, chat_body: dict[str, Any]) -> int:
        async with self.open_chat(request, model, {"messages": chat_body["messages"]}, "/tokenize") as upstream:
            if upstream.status != 200:
                return 0
            return int(json.loads(await upstream.read()).get("count", 0))
