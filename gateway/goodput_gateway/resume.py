"""Streams that survive their replica: a streamed completion or chat completion whose replica goes away
after the client got its first byte continues on another ready replica.

The gateway asks the runtime for token ids on every stream it may resume (`return_token_ids`, vLLM's
field, stripped from what the client sees unless it asked for it), and keeps the prompt's ids and each
choice's ids produced so far (resume_choice.py). When the replica's connection breaks mid-stream, each
choice that had not finished goes on on another replica as its own `/v1/completions` request whose prompt is
those ids (nothing is re-tokenized), with `max_tokens` and `min_tokens` less what the choice produced and the
same sampling fields; the choices' streams run side by side and their chunks come back in the original's
shape under the choice's own `index`: the same id, created time and model, chat deltas for a chat stream,
one usage chunk counting the whole answer. The client sees one stream.

Greedy requests continue token for token as an unbroken run would. A seeded sampled request continues
from the same tokens, deterministically for a given break point, but not with the tokens the unbroken run
would have drawn (the rest of choice i is sampled afresh from the seed plus i, the seed the runtime gives
choice i). Presence and frequency penalties count a choice's whole output: its continuation names the ids
produced so far as its own earlier output (`resume_output_ids`, the runtime's field), and a replica whose
answer does not say it took them (its `x-goodput-resume-output-ids` header) is not used. Logprobs and
structured output go on too (resume_fields.py): the continuation asks for its tokens' logprobs, a chat
stream's in the chat shape, and a grammar goes on from the ids named as earlier output. Streams that carry
state the runtime cannot take up from token ids are not resumed and end with the `upstream_lost` error event
as before: tools (the tool parser holds back text whose ids it reports, and its state is not carried over),
`echo` with `n` > 1 (a choice that had not begun would lose its echoed prompt), and fields the gateway does
not know.

Stop strings are resumed where the replica reports each token's id only once its text has been sent (its
response says `x-goodput-token-ids: shown`): text held back while it may begin a stop string belongs to
tokens the gateway has not been told of, so the next replica generates them again and sends their text.
The stop strings go with the rest, and none can straddle the break: one beginning in the text sent ends
within the text the first replica had, which it searched. A replica that does not say so (an older
runtime) leaves such a stream unresumed, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

from goodput_gateway.errors import APIError
from goodput_gateway.resume_choice import SAMPLING, Choice
from goodput_gateway.resume_fields import carries, echoed, logprobs_asked

logger = logging.getLogger(__name__)

PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> whether it is a chat stream
# fields allowed only at the value that makes them do nothing
HARMLESS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "suffix": (None, ""),
}
HOLDS_NOTHING: tuple[Any, ...] = (None, "", [])
OTHER = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "seed",  # each choice's own (resume_choice.choice_seed)
    }
)
MAX_RESUMES = 2  # per choice
IDS_SHOWN = ("x-goodput-token-ids", "shown")  # the runtime's header: each token's id comes with its text


def ids_shown(headers: Mapping[str, str]) -> bool:
    return headers.get(IDS_SHOWN[0]) == IDS_SHOWN[1]


def resumable(path: str, body: Mapping[str, Any]) -> bool:
    """Whether a request's stream can be taken up on another replica from its token ids."""
    if path not in PATHS or body.get("stream") is not True:
        return False
    return why_not(body) is None


def choices_of(body: Mapping[str, Any]) -> int | None:
    """The request's number of choices; None where `n` is not one the runtime takes."""
    n = body.get("n")
    if n is None:
        return 1
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def why_not(body: Mapping[str, Any]) -> str | None:
    """The field that keeps a stream from being taken up elsewhere (the lost stream's error names it); None
    where none does."""
    if not isinstance(body.get("return_token_ids", False), bool):  # the runtime refuses it, by name
        return "return_token_ids"
    n = choices_of(body)
    if n is None:
        return "n"
    for name, value in body.items():
        if name in ("return_token_ids", "n") or name in SAMPLING or name in OTHER:
            continue
        if name == "best_of" and value in (None, n):
            continue
        if name == "echo" and value in (None, False, True) and (n == 1 or not value):
            continue  # the prompt went with the first chunk; the rest carries none
        if carries(name, value, body):  # logprobs, structured output (resume_fields.py)
            continue
        if name not in HARMLESS or value not in HARMLESS[name]:
            return name
    return None


def with_token_ids(raw: bytes) -> bytes:
    """The body sent upstream for a stream the gateway may resume: token ids asked for."""
    body = json.loads(raw)
    if body.get("return_token_ids") is True:
        return raw
    return json.dumps({**body, "return_token_ids": True}).encode()


def event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


Reopen = Callable[[bytes, set[str]], contextlib.AbstractAsyncContextManager[Any]]


class Resumption:
    """One resumable stream's state and its translation; `run` yields the client's events."""

    def __init__(
        self,
        path: str,
        body: Mapping[str, Any],
        served_model: str,
        reopen: Reopen,
        lost: tuple[type[BaseException], ...],
        on_resume: Callable[[float], None] | None = None,
    ) -> None:
        self.chat = PATHS[path]
        self.body, self.served_model, self.reopen, self.lost = body, served_model, reopen, lost
        self.on_resume = on_resume
        self.client_ids = body.get("return_token_ids") is True
        self.include_usage = isinstance(body.get("stream_options"), dict) and bool(
            body["stream_options"].get("include_usage")
        )
        self.prompt: list[int] | None = None
        self.choices = [Choice(i) for i in range(choices_of(body) or 1)]
        self.template: dict[str, Any] = {}
        self.usage_sent = False
        self.failed = False  # a continuation reported an error in its stream: it ends without usage
        self.dead: set[str] = set()
        self.stops = body.get("stop") not in HOLDS_NOTHING  # text may be held back for a stop string
        self.logprobs = logprobs_asked(body)

    @property
    def ids_shown(self) -> bool:
        """Whether every choice's replica reports a token's id only once its text is sent."""
        return all(c.ids_shown for c in self.choices)

    @ids_shown.setter
    def ids_shown(self, value: bool) -> None:  # the first replica's, for every choice
        for choice in self.choices:
            choice.ids_shown = value

    async def run(self, first: AsyncIterator[bytes], replica: str) -> AsyncGenerator[bytes, None]:
        """The client's stream: the first replica's events, then, after a loss, each unfinished choice's
        continuation translated. Raises the loss where the stream cannot be resumed."""
        try:
            async for data in self.events(first, None):
                yield data
            return
        except self.lost as err:
            loss: BaseException = err
        lost_at = time.monotonic()
        self.dead.add(replica)
        if self.prompt is None:
            raise loss
        going = [c for c in self.choices if not c.finished]
        if self.stops and any(not c.ids_shown for c in going):
            raise loss
        logger.info("Resuming a stream's %d choices after a loss: %r", len(going), loss)
        followers = [self.follow(c, loss, lost_at) for c in going]
        async for data in followers[0] if len(followers) == 1 else merged(followers):
            yield data
        if self.include_usage and not self.usage_sent and not self.failed:
            yield event({**self.envelope([]), "usage": self.usage()})
        yield event("[DONE]")

    async def follow(self, choice: Choice, loss: BaseException, lost_at: float) -> AsyncGenerator[bytes, None]:
        """One choice's events from its continuations, until it ends; raises the loss where it cannot go on."""
        while not choice.finished:
            choice.lost()
            if self.logprobs and choice.logged - echoed(self.body, self.prompt) != len(choice.produced):
                raise loss  # its replica sent logprobs of tokens it had not reported: the client would get them twice
            if choice.budget(self.body) <= 0:  # nothing left to generate: the choice's end, made here
                yield event(self.envelope([self.choice_chunk(choice.index, "", "length", [])]))
                return
            if choice.resumes >= MAX_RESUMES:
                raise loss
            choice.resumes += 1
            assert self.prompt is not None
            rest = choice.rest(self.body, self.prompt, self.served_model)
            try:
                async with self.reopen(json.dumps(rest).encode(), self.dead) as upstream:
                    if upstream.status != 200 or not choice.taken_up(rest, upstream.headers):
                        raise loss
                    choice.ids_shown = ids_shown(upstream.headers)
                    if self.on_resume is not None:
                        self.on_resume(time.monotonic() - lost_at)
                    try:
                        async for data in self.events(upstream.iter_any(), choice):
                            yield data
                    except self.lost as err:
                        loss, lost_at = err, time.monotonic()
                        self.dead.add(upstream.replica)
                    else:
                        if choice.finished or self.failed:
                            return
                        raise loss  # the continuation's stream ended short of its finish
            except APIError:  # no other replica answered
                raise loss from None
            if self.stops and not choice.ids_shown and not choice.finished:
                raise loss

    def usage(self) -> dict[str, Any]:
        prompt = len(self.prompt or ())
        produced = sum(len(c.produced) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": produced, "total_tokens": prompt + produced}

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {**self.template, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return body

    def choice_chunk(
        self, index: int, text: str, finish_reason: str | None, ids: list[int], logprobs: Any = None
    ) -> dict[str, Any]:
        if self.chat:  # as the runtime's chat chunks: a token's logprobs come with its (maybe empty) content
            choice: dict[str, Any] = {
                "index": index,
                "delta": {"content": text} if text or logprobs else {},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.client_ids:
            choice["token_ids"] = ids
        return choice

    async def events(self, chunks: AsyncIterator[bytes], choice: Choice | None) -> AsyncIterator[bytes]:
        """Whole events, recorded and (a choice's continuation) translated; a loss mid-event drops its
        start. `choice`: None for the first replica's stream."""
        pending = b""
        async for chunk in chunks:
            pending += chunk
            cut = pending.rfind(b"\n\n")
            if cut < 0:
                continue
            whole, pending = pending[: cut + 2], pending[cut + 2 :]
            out = b"".join(self.translate(e + b"\n\n", choice) for e in whole.split(b"\n\n") if e.strip())
            if out:
                yield out
        if pending.strip() and (out := self.translate(pending, choice)):
            yield out

    def translate(self, raw: bytes, choice: Choice | None) -> bytes:
        if not raw.startswith(b"data:"):
            return raw if choice is None else b""
        data = raw[5:].strip()
        if data == b"[DONE]":  # a continuation's: the stream's own comes when every choice has ended
            return raw if choice is None else b""
        try:
            chunk = json.loads(data)
        except ValueError:
            return raw
        if not isinstance(chunk, dict) or "error" in chunk:
            self.failed = self.failed or choice is not None
            return raw
        if choice is None:
            return self.record(chunk, raw)
        return self.resumed(chunk, choice)

    def record(self, chunk: dict[str, Any], raw: bytes) -> bytes:
        """An event of the first replica: its ids kept, and stripped unless the client asked for them."""
        changed = False
        if "prompt_token_ids" in chunk:
            self.prompt = chunk["prompt_token_ids"] if self.client_ids else chunk.pop("prompt_token_ids")
            changed = not self.client_ids
        if not self.template and "id" in chunk:
            keys = ("id", "object", "created", "model", "system_fingerprint")
            self.template = {k: chunk[k] for k in keys if k in chunk}
        for part in chunk.get("choices") or ():
            ids = part.get("token_ids") if self.client_ids else part.pop("token_ids", None)
            changed = changed or not self.client_ids
            text = part.get("text") if "text" in part else (part.get("delta") or {}).get("content")
            index = part.get("index", 0)
            if isinstance(index, int) and 0 <= index < len(self.choices):
                self.choices[index].took(ids or [], text or "", part.get("finish_reason"))
                self.choices[index].logprobs(part.get("logprobs"), resumed=False)
        if chunk.get("usage"):
            self.usage_sent = True
        return event(chunk) if changed else raw

    def resumed(self, chunk: dict[str, Any], choice: Choice) -> bytes:
        """An event of a choice's continuation, in the original stream's shape; its usage is left for the
        stream's own, which counts every choice."""
        parts = []
        for part in chunk.get("choices") or ():
            ids = part.get("token_ids") or []
            choice.took(ids, part.get("text") or "", part.get("finish_reason"))
            text = part.get("text") or ""
            logprobs = choice.logprobs(part.get("logprobs"), resumed=True)
            parts.append(
                self.choice_chunk(choice.index, text, part.get("finish_reason"), choice.unshown(ids), logprobs)
            )
        return event(self.envelope(parts)) if parts else b""


async def merged(streams: list[AsyncGenerator[bytes, None]]) -> AsyncIterator[bytes]:
    """The streams' items as they come, side by side: each stream has one item in flight, and reads its next
    once the client took it (a slow client slows them all; none crowds out another). The first error ends
    them all and is raised."""
    queue: asyncio.Queue[tuple[bytes | None, BaseException | None, asyncio.Event | None]] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[bytes, None]) -> None:
        async with contextlib.aclosing(stream):
            try:
                async for item in stream:
                    taken = asyncio.Event()
                    queue.put_nowait((item, None, taken))
                    await taken.wait()
            except Exception as err:
                queue.put_nowait((None, err, None))
                return
        queue.put_nowait((None, None, None))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item, err, taken = await queue.get()
            if err is not None:
                raise err
            if item is None:
                left -= 1
                continue
            yield item
            assert taken is not None
            taken.set()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
