"""A streamed Responses answer: the chat completion's events as the Responses events, each numbered."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from goodput_gateway.apis import chat
from goodput_gateway.apis.response_objects import Exchange, call_item, message_item, new_id


class EventStream:
    """The Responses events of one streamed answer, each numbered."""

    def __init__(self, response: web.StreamResponse, exchange: Exchange) -> None:
        self.out, self.exchange, self.seq = response, exchange, 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.text = ""

    async def send(self, kind: str, **payload: Any) -> None:
        data = json.dumps({"type": kind, "sequence_number": self.seq, **payload}, separators=(",", ":"))
        self.seq += 1
        await self.out.write(f"event: {kind}\ndata: {data}\n\n".encode())

    async def begin(self) -> None:
        started = self.exchange.response("in_progress", [])
        await self.send("response.created", response=started)
        await self.send("response.in_progress", response=started)

    async def text_delta(self, delta: str) -> None:
        if self.open is None or self.open["type"] != "message":
            await self.close()
            self.open = message_item(new_id("msg_"), "", "in_progress")
            self.text = ""
            await self.send("response.output_item.added", output_index=len(self.items), item=self.open)
            await self.send(
                "response.content_part.added",
                item_id=self.open["id"],
                output_index=len(self.items),
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        self.text += delta
        await self.send(
            "response.output_text.delta",
            item_id=self.open["id"],
            output_index=len(self.items),
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    async def call_start(self, event: chat.ToolStart) -> None:
        await self.close()
        self.open = call_item(new_id("fc_"), {"id": event.call_id, "name": event.name, "arguments": ""}, "in_progress")
        await self.send("response.output_item.added", output_index=len(self.items), item=self.open)

    async def call_args(self, delta: str) -> None:
        if self.open is None or self.open["type"] != "function_call":
            return
        self.open["arguments"] += delta
        await self.send(
            "response.function_call_arguments.delta", item_id=self.open["id"], output_index=len(self.items), delta=delta
        )

    async def close(self) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        index = len(self.items)
        if item["type"] == "message":
            done = message_item(item["id"], self.text)
            part = done["content"][0]
            await self.send(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=self.text,
                logprobs=[],
            )
            await self.send(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
            )
        else:
            done = {**item, "status": "completed"}
            await self.send(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
        self.items.append(done)
        await self.send("response.output_item.done", output_index=index, item=done)

    async def run(self, upstream: Any, keep: Callable[[chat.Turn, dict[str, Any]], Any]) -> chat.Turn:
        """The events of the whole answer; `keep` stores it before the last event tells the client it is done."""
        turn = chat.Turn()
        await self.begin()
        async for event in chat.events(upstream):
            turn.add(event)
            if isinstance(event, chat.Text):
                await self.text_delta(event.text)
            elif isinstance(event, chat.ToolStart):
                await self.call_start(event)
            elif isinstance(event, chat.ToolArgs):
                await self.call_args(event.delta)
        if turn.failed is None and not self.items and self.open is None and not turn.calls:
            await self.text_delta("")  # an empty answer still has its message item
        await self.close()
        final = self.exchange.finished(turn, self.items)
        await keep(turn, final)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            final["status"], "response.failed"
        )
        await self.send(kind, response=final)
        return turn
