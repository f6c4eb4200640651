"""A Messages answer as it is gathered: the stop sequences matched on the text as it comes (a sequence split
across chunks included), and the content blocks, stop and usage the answer collects."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from goodput_gateway.apis import chat

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class Stopped:
    def __init__(self, sequence: str) -> None:
        self.sequence = sequence


async def with_stops(events: AsyncIterator[chat.Event], stops: tuple[str, ...]) -> AsyncIterator[chat.Event | Stopped]:
    """The events with the stop sequences applied to the text: text that could still begin one is held back
    until it cannot; a match ends the events with `Stopped` (the text before it passed on)."""
    if not stops:
        async for event in events:
            yield event
        return
    hold = max(len(s) for s in stops) - 1
    pending = ""
    async for event in events:
        if not isinstance(event, chat.Text):
            if pending and isinstance(event, (chat.ToolStart, chat.Finish, chat.Failed)):
                yield chat.Text(pending)
                pending = ""
            yield event
            continue
        pending += event.text
        found = [(at, s) for s in stops if (at := pending.find(s)) != -1]
        if found:
            at, sequence = min(found)
            if at:
                yield chat.Text(pending[:at])
            yield Stopped(sequence)
            return
        if len(pending) > hold:
            yield chat.Text(pending[: len(pending) - hold])
            pending = pending[len(pending) - hold :]
    if pending:
        yield chat.Text(pending)


class Answer:
    """What one answer gathered: content blocks, the stop, the usage."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = chat.Usage(0, 0)
        self.tokens = 0
        self.failed: chat.Failed | None = None

    def add(self, event: chat.Event | Stopped) -> None:
        if isinstance(event, chat.Text):
            if not self.blocks or self.blocks[-1]["type"] != "text":
                self.blocks.append({"type": "text", "text": ""})
            self.blocks[-1]["text"] += event.text
        elif isinstance(event, chat.ToolStart):
            self.blocks.append({"type": "tool_use", "id": event.call_id, "name": event.name, "input": {}, "json": ""})
        elif isinstance(event, chat.ToolArgs) and self.blocks and self.blocks[-1]["type"] == "tool_use":
            self.blocks[-1]["json"] += event.delta
        elif isinstance(event, chat.Finish):
            self.stop_reason = STOP_REASONS.get(event.reason, "end_turn")
        elif isinstance(event, chat.Usage):
            self.usage = event
        elif isinstance(event, chat.Tokens):
            self.tokens += event.count
        elif isinstance(event, chat.Failed):
            self.failed = event
        elif isinstance(event, Stopped):
            self.stop_reason, self.stop_sequence = "stop_sequence", event.sequence

    def content(self) -> list[dict[str, Any]]:
        out = []
        for block in self.blocks:
            if block["type"] == "tool_use":
                try:
                    arguments = json.loads(block["json"] or "{}")
                except ValueError:
                    arguments = {}
                block = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": arguments}
            out.append(block)
        return out

    def usage_object(self) -> dict[str, int]:
        return {
            "input_tokens": self.usage.prompt_tokens,
            "output_tokens": self.usage.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.usage.cached_tokens,
        }
