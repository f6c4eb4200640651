"""One choice of a resumable stream (resume.py): the ids it produced, how many of them the client has the
text of, whether it finished; and the `/v1/completions` request that takes it up on another replica."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from goodput_gateway.resume_fields import carried, confirmed, guided

# request fields a resumed stream keeps as they came
SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "repetition_penalty",
    "presence_penalty",  # with the produced ids named as output (RESUME_OUTPUT_IDS)
    "frequency_penalty",
    "priority",
    "user",
    "stop",  # resumed only from a replica that reports ids once their text is sent (IDS_SHOWN)
)
PENALTIES = ("presence_penalty", "frequency_penalty")
# the runtime's field: the prompt's last K ids are the request's own earlier output, which the presence and
# frequency penalties count as output and a grammar goes on from; its answer says it took them in the header
# of the second name
RESUME_OUTPUT_IDS = ("resume_output_ids", "x-goodput-resume-output-ids")
SEED_MODULUS = 2**64


def penalized(body: Mapping[str, Any]) -> bool:
    """Whether the request's presence or frequency penalty counts its output."""
    return any(body.get(name) not in (None, 0, 0.0) for name in PENALTIES)


def choice_seed(seed: Any, index: int) -> Any:
    """Choice `index`'s own seed, as the runtime gives each choice of a request: the seed plus the index,
    within 64 bits."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        return seed
    seed += index
    return seed - SEED_MODULUS if seed >= SEED_MODULUS else seed


@dataclass
class Choice:
    """One choice's progress through the stream, whichever replica produces it."""

    index: int
    produced: list[int] = field(default_factory=list)
    # produced tokens whose text the client has: those after it are held back by the runtime (a character's
    # first bytes, a stop string's possible start), and are generated again on a resume rather than sent
    shown: int = 0
    repeated: int = 0  # ids of tokens generated again that the client already got (when it asked for ids)
    finished: bool = False  # its finish_reason was sent
    # its replica reports a token's id only once its text is sent (IDS_SHOWN): every id is shown
    ids_shown: bool = False
    resumes: int = 0
    logged: int = 0  # tokens whose logprobs the client has (an echoed prompt's included)
    offset: int = 0  # completions' logprobs: the text_offset of the next token
    base: int = 0  # completions' logprobs: where the text_offsets of the current continuation start

    def took(self, ids: list[int], text: str, finish_reason: str | None) -> None:
        """A chunk of this choice: tokens produced, and whether their text came with them."""
        self.produced.extend(ids)
        if text or finish_reason is not None or self.ids_shown:
            self.shown = len(self.produced)
        if finish_reason is not None:
            self.finished = True

    def lost(self) -> None:
        """Its replica went away: the tokens whose text the client has not had are generated again."""
        self.repeated = len(self.produced) - self.shown
        del self.produced[self.shown :]
        self.base = self.offset

    def logprobs(self, logprobs: Any, resumed: bool) -> Any:
        """A chunk's logprobs, counted; a completions continuation's text offsets moved on past the text
        the client had before it."""
        if not isinstance(logprobs, dict):
            return logprobs
        if "content" in logprobs:  # the chat shape
            self.logged += len(logprobs.get("content") or ())
            return logprobs
        tokens, offsets = logprobs.get("tokens") or [], logprobs.get("text_offset") or []
        if resumed:
            offsets = [offset + self.base for offset in offsets]
            logprobs = {**logprobs, "text_offset": offsets}
        if tokens and offsets:
            self.offset = offsets[-1] + len(tokens[-1])
        self.logged += len(tokens)
        return logprobs

    def unshown(self, ids: list[int]) -> list[int]:
        """A continuation's ids less those the client already got."""
        skip = min(self.repeated, len(ids))
        self.repeated -= skip
        return ids[skip:]

    def budget(self, body: Mapping[str, Any]) -> int:
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        return limit - len(self.produced) if isinstance(limit, int) else 1

    def rest(self, body: Mapping[str, Any], prompt: list[int], served_model: str) -> dict[str, Any]:
        """The continuation: a `/v1/completions` stream of this choice alone from the ids so far."""
        rest: dict[str, Any] = {
            "model": served_model,
            "prompt": prompt + self.produced,
            "stream": True,
            "return_token_ids": True,
        }
        rest.update({k: body[k] for k in SAMPLING if k in body})
        if "seed" in body:
            rest["seed"] = choice_seed(body["seed"], self.index)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(limit, int):
            rest["max_tokens"] = limit - len(self.produced)
        min_tokens = body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > len(self.produced):
            rest["min_tokens"] = min_tokens - len(self.produced)
        if (penalized(body) or guided(body)) and self.produced:
            rest[RESUME_OUTPUT_IDS[0]] = len(self.produced)
        return {**rest, **carried(body)}

    def taken_up(self, rest: Mapping[str, Any], headers: Mapping[str, str]) -> bool:
        """Whether the replica answering `rest` took all of it: a runtime that does not know
        `resume_output_ids` ignores it, and its penalties would count the produced ids as prompt (nor would
        its grammar go on from them, nor its logprobs come in the chat shape: resume_fields.py)."""
        wanted = rest.get(RESUME_OUTPUT_IDS[0])
        if wanted is not None and headers.get(RESUME_OUTPUT_IDS[1]) != str(wanted):
            return False
        return confirmed(rest, headers, wanted)
