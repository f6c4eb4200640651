"""One generation request against the engine, answered whole or as server-sent events."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from aiohttp import web

from goodput_runtime.engine.client import EngineClient
from goodput_runtime.engine.kv_transfer.base import KVTransferError
from goodput_runtime.engine.kv_transfer.params import HandoffParams
from goodput_runtime.engine.lora_manager import LoraError
from goodput_runtime.engine.outputs import (
    EngineStoppedError,
    InvalidPromptError,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    TokenLogprob,
)
from goodput_runtime.engine.sequence import PoolingParams
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.server.errors import APIError, internal, invalid, queue_full, unavailable
from goodput_runtime.server.kv_transfer_fields import KVTransferRequest, kv_transfer_failed
from goodput_runtime.server.responses import Choice, Shape, usage
from goodput_runtime.structured.tool_parsers import ToolStream, parse, parse_forced

log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# on a stream with return_token_ids: each token's id comes with its text (TokenIds), so a stream can be
# continued elsewhere from the ids sent, stop strings and all (the gateway's resume reads it)
TOKEN_IDS_HEADER = ("x-goodput-token-ids", "shown")


class Tracker:
    """Request ids the server is answering; shutdown waits on it to drain."""

    def __init__(self) -> None:
        self.active: set[str] = set()

    def __len__(self) -> int:
        return len(self.active)


@dataclass(frozen=True, slots=True)
class ToolSetup:
    """How a chat request's output turns into tool calls: the parser's format, the tools' names, and
    whether a grammar forced the call (required, or the one named function)."""

    fmt: str
    names: frozenset[str]
    forced: bool
    named: str | None  # tool_choice's function: the output is its arguments object
    parallel: bool

    def stream(self) -> ToolStream:
        return ToolStream(self.fmt, self.names, self.forced, self.named, self.parallel)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls as OpenAI shapes them) of a whole choice."""
        if self.forced:
            calls = parse_forced(text, self.named, self.names)
            content = None if calls else text
        else:
            content, calls = parse(text, self.fmt, self.names)
        if not self.parallel:
            calls = calls[:1]
        return content, [c.as_openai() for c in calls]


class Pieces:
    """Turns a request's outputs into each choice's pieces of text and logprobs: the echoed prompt
    first when asked for, then what the choice generated."""

    def __init__(
        self, shape: Shape, prompt_ids: list[int], params: SamplingParams, echo_text: str | None = None
    ) -> None:
        self.shape = shape
        self.prompt_ids = prompt_ids
        self.echo_text = echo_text
        self.want_logprobs = params.logprobs is not None
        self.started: set[int] = set()
        self.output_tokens: dict[int, int] = {}

    def take(self, out: RequestOutput) -> tuple[str, list[tuple[int, TokenLogprob | None]]]:
        """The text and (token id, logprob) entries this output adds to its choice."""
        text = out.text
        entries: list[tuple[int, TokenLogprob | None]] = []
        self.output_tokens[out.index] = out.num_output_tokens
        if out.index not in self.started:
            self.started.add(out.index)
            if self.echo_text is not None:
                text = self.echo_text + text
            if out.prompt_logprobs:
                entries.append((self.prompt_ids[0], None))
                entries.extend((e.token_id, e) for e in out.prompt_logprobs[1:] if e is not None)
        if out.logprobs:
            entries.extend((e.token_id, e) for e in out.logprobs)
        return text, entries

    def logprobs(self, index: int, entries: list[tuple[int, TokenLogprob | None]], text: str) -> dict | None:
        return self.shape.logprobs(index, entries, text) if self.want_logprobs else None

    def usage(self, last: RequestOutput) -> dict:
        return usage(last.num_prompt_tokens, sum(self.output_tokens.values()), last.num_cached_tokens)


async def generate(
    request: web.Request,
    engine: EngineClient,
    tracker: Tracker,
    shape: Shape,
    prompt_ids: list[int],
    params: SamplingParams,
    stream: bool,
    prompt_param: str,
    echo_text: str | None = None,
    tools: ToolSetup | None = None,
    count_calls: Callable[[int], None] | None = None,
    headers: dict[str, str] | None = None,
    kv: KVTransferRequest | None = None,
) -> web.StreamResponse:
    if kv is not None and kv.handoff is not None:
        outputs = await admit_handoff(engine, shape.id, prompt_ids, params, prompt_param, kv.handoff)
    else:
        outputs = admit(engine, shape.id, prompt_ids, params, prompt_param, kv_role=kv.role if kv else None)
    if shape.return_token_ids:
        shape.prompt_token_ids = prompt_ids
    tracker.active.add(shape.id)
    pieces = Pieces(shape, prompt_ids, params, echo_text)
    finished = False
    try:
        if stream:
            response, finished = await stream_events(request, shape, outputs, pieces, tools, count_calls, headers)
            return response
        choices, last = await collect(outputs, pieces, tools)
        finished = True
        if count_calls is not None:
            count_calls(sum(len(c.tool_calls or []) for c in choices))
        body = shape.response(choices, pieces.usage(last))
        if kv is not None and kv.role == "prefill":
            body["kv_transfer_params"] = last.kv_transfer_params  # the hand-off a decode runtime pulls by
        return web.json_response(body, headers=headers)
    finally:
        if not finished:
            # the client left (or we failed) before the end: free the request's KV blocks now
            engine.abort(shape.id)
            log.info("Aborted request %s before it finished", shape.id)
        tracker.active.discard(shape.id)


@contextlib.contextmanager
def admission_errors(prompt_param: str) -> Iterator[None]:
    """What adding a request may raise, as the API's errors."""
    try:
        yield
    except KVTransferError as exc:  # a decode phase's, under --kv-failure-policy fail
        raise kv_transfer_failed(f"The KV hand-off failed ({exc.reason}): {exc}") from None
    except QueueFullError:
        raise queue_full() from None
    except PromptTooLongError as exc:
        raise invalid(str(exc), prompt_param, "context_length_exceeded") from None
    except InvalidPromptError as exc:
        raise invalid(f"'{prompt_param}' cannot be served: {exc}", prompt_param) from None
    except EngineStoppedError:
        raise unavailable("The server is shutting down and accepts no new requests", "shutting_down") from None
    except LoraError as exc:  # the adapter was unloaded since the request was parsed
        raise APIError(exc.status, str(exc), param="model", code=exc.code) from None


def admit(
    engine: EngineClient,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    prompt_param: str,
    pooling: PoolingParams | None = None,
    kv_role: str | None = None,
) -> AsyncIterator[RequestOutput]:
    with admission_errors(prompt_param):
        if pooling is not None:
            return engine.add_request(request_id, prompt_ids, params, pooling)
        if kv_role is not None:
            return engine.add_request(request_id, prompt_ids, params, kv_role=kv_role)
        return engine.add_request(request_id, prompt_ids, params)


async def admit_handoff(
    engine: EngineClient,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    prompt_param: str,
    handoff: HandoffParams,
) -> AsyncIterator[RequestOutput]:
    """admit, for a decode phase: the prompt's blocks are pulled first (engine/kv_transfer/)."""
    with admission_errors(prompt_param):
        return await engine.add_handoff_request(request_id, prompt_ids, params, handoff)


async def collect(
    outputs: AsyncIterator[RequestOutput], pieces: Pieces, tools: ToolSetup | None = None
) -> tuple[list[Choice], RequestOutput]:
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    entries: dict[int, list[tuple[int, TokenLogprob | None]]] = {}
    reasons: dict[int, str | None] = {}
    last = None
    async for out in outputs:
        text, new = pieces.take(out)
        texts.setdefault(out.index, []).append(text)
        ids.setdefault(out.index, []).extend(out.token_ids)
        entries.setdefault(out.index, []).extend(new)
        reasons[out.index] = out.finish_reason
        last = out
        if out.finished:
            break
    if last is None or not last.finished:
        raise RuntimeError("The engine ended a request's stream without a finished output")
    choices = []
    for index in sorted(texts):
        text = "".join(texts[index])
        choice = Choice(index, text, reasons[index], pieces.logprobs(index, entries[index], text), token_ids=ids[index])
        if tools is not None:
            content, calls = tools.parse(text)
            if calls:
                choice.text, choice.tool_calls = content, calls
                choice.finish_reason = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
        choices.append(choice)
    return choices, last


def event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def stream_events(
    request: web.Request,
    shape: Shape,
    outputs: AsyncIterator[RequestOutput],
    pieces: Pieces,
    tools: ToolSetup | None = None,
    count_calls: Callable[[int], None] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[web.StreamResponse, bool]:
    """Stream chunks until the engine finishes; report whether it did. Chunks of a request's
    choices interleave, each carrying its choice's index. With tools, a choice's text goes through
    its ToolStream: content until a call begins, then tool_calls deltas."""
    response = web.StreamResponse(headers={**SSE_HEADERS, **(headers or {})})
    if shape.return_token_ids:
        response.headers[TOKEN_IDS_HEADER[0]] = TOKEN_IDS_HEADER[1]
    await response.prepare(request)
    finished = False
    streams: dict[int, ToolStream] = {}
    opened = False
    ids = TokenIds(shape)
    try:
        async for out in outputs:
            if not opened:  # the role chunks wait for the first output: a replica lost while the request
                # queues or prefills has sent no body byte yet, so the gateway may still send it elsewhere
                for chunk in shape.first_chunks():
                    await response.write(event(ids.on(chunk)))
                opened = True
            text, entries = pieces.take(out)
            reason = out.finish_reason
            ids.produced(out)
            entries = ids.logprobs(out, entries)
            if tools is not None:
                calls = streams.setdefault(out.index, tools.stream())
                deltas = calls.feed(text) + (calls.finish() if reason is not None else [])
                logprobs = pieces.logprobs(out.index, entries, text) if entries else None
                for i, delta in enumerate(deltas or ([{}] if logprobs or ids.pending else [])):
                    await response.write(
                        event(
                            ids.on(
                                shape.delta(  # type: ignore[attr-defined]
                                    delta,
                                    index=out.index,
                                    logprobs=logprobs if i == 0 else None,
                                )
                            )
                        )
                    )
                if reason is not None and calls.made_calls:
                    if count_calls is not None:
                        count_calls(calls.num_calls)
                    reason = "tool_calls" if reason == "stop" else reason
            elif text or entries or (ids.pending and reason is None):
                logprobs = pieces.logprobs(out.index, entries, text)
                await response.write(event(ids.on(shape.chunk(text, index=out.index, logprobs=logprobs))))
            if reason is not None:
                await response.write(event(ids.on(shape.chunk("", reason, index=out.index))))
            if out.finished:
                finished = True
                if shape.include_usage:
                    await response.write(event(shape.usage_chunk(pieces.usage(out))))
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


class TokenIds:
    """vLLM's return_token_ids on a stream: the prompt's ids on its first chunk, and each choice's token ids
    on the chunk that carries their text (an empty list on the others). A token whose text is held back (a
    stop string's possible start, a character's first bytes) has its id held with it: the ids sent are
    always the tokens of the text sent, so the stream can be taken up elsewhere from them (the gateway's
    resume), and every id has come by the choice's last chunk. A token's logprobs are held with its id: they
    too come with its text."""

    def __init__(self, shape: Shape) -> None:
        self.on_shape = shape.return_token_ids
        self.prompt = shape.prompt_token_ids
        self.pending: list[int] = []
        self.held: dict[int, list[int]] = {}  # per choice: ids produced whose text has not been sent
        self.sent: dict[int, int] = {}  # per choice: ids sent
        self.released: dict[int, int] = {}  # per choice: ids the last output let go
        self.held_logprobs: dict[int, list[tuple[int, TokenLogprob | None]]] = {}
        self.first = True

    def produced(self, out: RequestOutput) -> None:
        if not self.on_shape:
            return
        held = self.held.setdefault(out.index, [])
        held.extend(out.token_ids)
        sent = self.sent.get(out.index, 0)
        shown = sent + len(held) if out.num_shown_tokens is None else out.num_shown_tokens
        ready = held[: max(0, shown - sent)]
        del held[: len(ready)]
        self.sent[out.index] = sent + len(ready)
        self.released[out.index] = len(ready)
        self.pending = self.pending + ready

    def logprobs(
        self, out: RequestOutput, entries: list[tuple[int, TokenLogprob | None]]
    ) -> list[tuple[int, TokenLogprob | None]]:
        """The logprob entries `out`'s chunk carries: an echoed prompt's at once, a generated token's once
        its id goes (after `produced`)."""
        if not self.on_shape:
            return entries
        new = len(out.logprobs or ())
        held = self.held_logprobs.setdefault(out.index, [])
        held.extend(entries[len(entries) - new :])
        ready = held[: self.released.get(out.index, 0)]
        del held[: len(ready)]
        return entries[: len(entries) - new] + ready

    def on(self, chunk: dict) -> dict:
        if not self.on_shape:
            return chunk
        if self.first:
            chunk["prompt_token_ids"] = self.prompt
            self.first = False
        for choice in chunk["choices"]:
            choice["token_ids"], self.pending = self.pending, []
        return chunk


async def write_quietly(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError:
        pass
