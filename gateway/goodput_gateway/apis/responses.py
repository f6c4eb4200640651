"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`) on the runtime's chat
completions.

A request becomes one chat completion: `instructions` the system message, `input` (a string, or message,
`function_call` and `function_call_output` items) the conversation, function `tools` and `tool_choice`
the runtime's tool calls, `text.format` its structured output (`response_format`),
`max_output_tokens` its `max_tokens`. The answer comes back as a response object with `message` and
`function_call` output items, whole or streamed as the Responses events. With `store` (the default, as
OpenAI's) the response and its conversation are kept per caller (store.py), so `previous_response_id`
continues it. Every other field, and every tool other than a function (web_search, file_search, ...),
is refused with a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from goodput_gateway.apis import chat
from goodput_gateway.apis.response_events import EventStream
from goodput_gateway.apis.response_objects import Exchange, output_items
from goodput_gateway.apis.response_request import wrong_type
from goodput_gateway.apis.store import ResponseStore
from goodput_gateway.errors import APIError, invalid
from goodput_gateway.proxy import parse_body

ChatOpener = Callable[[web.Request, str, dict[str, Any]], Any]  # an async context manager of an Upstream


class ResponsesAPI:
    def __init__(
        self, open_chat: ChatOpener, store: ResponseStore, owner: Callable[[web.Request], Awaitable[str]]
    ) -> None:
        self.open_chat, self.store, self.owner = open_chat, store, owner

    async def history(self, owner: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        previous = body.get("previous_response_id")
        if previous is None:
            return []
        if not isinstance(previous, str):
            raise wrong_type("previous_response_id", "a string")
        found = await self.store.get(owner, previous)
        if found is None:
            raise APIError(
                404,
                f"Previous response with id '{previous}' not found.",
                "invalid_request_error",
                "previous_response_id",
                "previous_response_not_found",
            )
        return found[1]

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = parse_body(await request.read())
        owner = await self.owner(request)
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise wrong_type("stream", "a boolean")
        if not isinstance(body.get("model"), str):
            raise invalid("'model' is a required property and must be a string", "model", "missing_required_parameter")
        exchange = Exchange(body, await self.history(owner, body))

        async def keep(turn: chat.Turn, final: dict[str, Any]) -> None:
            if exchange.store and turn.failed is None:
                await self.store.put(owner, final, exchange.stored_conversation(turn))

        async with self.open_chat(request, exchange.model, exchange.chat) as upstream:
            if upstream.status != 200:
                err = await chat.error_body(upstream)
                raise APIError(
                    upstream.status,
                    str(err.get("message")),
                    err.get("type", "invalid_request_error"),
                    err.get("param"),
                    err.get("code"),
                )
            if stream:
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await out.prepare(request)
                await EventStream(out, exchange).run(upstream, keep)
                await out.write_eof()
                return out
            turn = await chat.gather(upstream)
        final = exchange.finished(turn, output_items(turn))
        await keep(turn, final)
        if turn.failed is not None:
            raise APIError(502, turn.failed.message, "server_error", None, turn.failed.code)
        return web.json_response(final)

    async def retrieve(self, request: web.Request) -> web.Response:
        found = await self.store.get(await self.owner(request), request.match_info["id"])
        if found is None:
            raise not_found(request.match_info["id"])
        return web.json_response(found[0])

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["id"]
        if not await self.store.delete(await self.owner(request), response_id):
            raise not_found(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", None, "not_found")
