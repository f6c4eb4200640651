"""A generated answer through the output guards on its way to the client: a stream chunk by chunk (each
guard holding back a window of text), a whole answer at once; a guard that blocks ends it with
`content_filter`."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from goodput_contract.api.pipeline_spec import Step
from goodput_gateway.pipelines.metrics import PipelineMetrics
from goodput_gateway.pipelines.outcome import CONTENT_FILTER, Outcome, record_block
from goodput_gateway.pipelines.stream import OutputFilter, Release
from goodput_gateway.pipelines.table import Entry
from goodput_gateway.proxy import Upstream


class OutputGuards:
    """One answer's output guard steps, each with its filter."""

    def __init__(self, entry: Entry, steps: list[Step], metrics: PipelineMetrics, result: Outcome) -> None:
        self.entry, self.metrics, self.result = entry, metrics, result
        self.filters = [(s, OutputFilter(entry.rules[s.name], s.hold_back)) for s in steps]

    def run(self, delta: str, final: bool = False) -> Release:
        """delta through every output guard in turn; `final`: the text ends here, release all of it."""
        text = delta
        for step, f in self.filters:
            began = time.perf_counter()
            release = f.feed(text)
            if final and not release.blocked_by:
                rest = f.finish()
                release = Release(release.text + rest.text, rest.blocked_by, release.redacted + rest.redacted)
            self.result.output_seconds[step.name] = (
                self.result.output_seconds.get(step.name, 0.0) + time.perf_counter() - began
            )
            for rule in release.redacted:
                self.metrics.redactions.labels(self.entry.namespace, self.entry.name, rule).inc()
            if release.blocked_by:
                record_block(self.metrics, self.entry, step, release.blocked_by, self.result)
                return Release(release.text, release.blocked_by)
            text = release.text
        return Release(text)


async def relay_stream(
    request: web.Request, upstream: Upstream, model: str, guards: OutputGuards, sent: float, result: Outcome
) -> web.StreamResponse:
    response = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    buffer = b""

    async def send(event: dict[str, Any]) -> None:
        await response.write(b"data: " + json.dumps({**event, "model": model}).encode() + b"\n\n")

    def with_text(chunk: dict[str, Any], text: str, finish: str | None) -> dict[str, Any]:
        choice = dict(chunk["choices"][0])
        if "delta" in choice:
            choice["delta"] = {**choice["delta"], "content": text} if text else {}
        else:
            choice["text"] = text
        choice["finish_reason"] = finish
        return {**chunk, "choices": [choice]}

    async def release(chunk: dict[str, Any], delta: str | None, finish: str | None) -> bool:
        """Send what the guards release; True once the stream has ended."""
        out = guards.run(delta or "", final=finish is not None)
        if out.text:
            result.first_text = result.first_text or time.monotonic()
            await send(with_text(chunk, out.text, None))
        if out.blocked_by:
            await send({**with_text(chunk, "", CONTENT_FILTER), "usage": None})
            await response.write(b"data: [DONE]\n\n")
            return True
        if finish is not None:
            await send(with_text(chunk, "", finish))
        return False

    ended = False
    async for piece in upstream.iter_any():
        buffer += piece
        while not ended and b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            data = event.strip()
            if not data.startswith(b"data:"):
                continue
            data = data[5:].strip()
            if data == b"[DONE]":
                await response.write(b"data: [DONE]\n\n")
                ended = True
                break
            chunk = json.loads(data)
            choices = chunk.get("choices") or []
            if not choices:  # the usage chunk, or an error event
                usage = chunk.get("usage") or {}
                result.tokens = int(usage.get("completion_tokens") or result.tokens)
                await send(chunk)
                continue
            choice = choices[0]
            delta = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
            finish = choice.get("finish_reason")
            if delta:
                result.generate_ttft = result.generate_ttft or time.monotonic() - sent
                result.tokens += 1
            elif finish is None:
                await send(chunk)  # the role chunk
                continue
            ended = await release(chunk, delta or "", finish)
        if ended:
            break
    await response.write_eof()
    return response


async def relay_whole(
    upstream: Upstream, model: str, guards: OutputGuards, sent: float, result: Outcome
) -> web.Response:
    answer = json.loads(await upstream.read())
    result.generate_ttft = time.monotonic() - sent
    for choice in answer.get("choices") or ():
        message = choice.get("message")
        text = (message.get("content") if message else choice.get("text")) or ""
        out = guards.run(text, final=True)
        if message is not None:
            message["content"] = out.text
        else:
            choice["text"] = out.text
        if out.blocked_by:
            choice["finish_reason"] = CONTENT_FILTER
    result.tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)
    result.first_text = time.monotonic()
    answer["model"] = model
    return web.json_response(answer)
