"""Tool calls out of a model's text, one parser per format, and their stream as OpenAI sends it.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Qwen, Hermes, SmolLM3)
    llama3_json  {"name": ..., "parameters": {...}}, optionally after <|python_tag|>, ";"-separated
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}]  or  [TOOL_CALLS]name[ARGS]{...}

`forced` is the format of a call made by a grammar (tool_choice required or a named function): a
JSON array of {"name", "parameters"} objects, or the named function's arguments object alone.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "mistral")
DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parser_for_template(template: str | None) -> str:
    """The format a chat template teaches its model, hermes when it names none."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def _call(obj: object, names: frozenset[str], key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(str(obj["name"]), json.dumps(arguments, ensure_ascii=False))


def _json_values(text: str, separators: str = " \t\r\n;,") -> list[object] | None:
    """The JSON values text holds one after another; None unless all of it is such values."""
    values: list[object] = []
    at = 0
    while True:
        while at < len(text) and text[at] in separators:
            at += 1
        if at == len(text):
            return values
        try:
            value, at = DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values.append(value)


HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse(text: str, fmt: str, names: frozenset[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; text with no well-formed call of a known tool is all content."""
    calls: list[ToolCall] = []
    content = text
    if fmt == "hermes":
        for match in HERMES.finditer(text):
            values = _json_values(match.group(1))
            found = [_call(v, names, "arguments") for v in values or []]
            if not values or None in found:
                return text, []
            calls.extend(c for c in found if c is not None)
        content = HERMES.sub("", text)
    elif fmt == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>")
        if body.startswith("{"):
            values = _json_values(body)
            found = [_call(v, names, "parameters") for v in values or []]
            if values and None not in found:
                calls, content = [c for c in found if c is not None], ""
    elif fmt == "mistral":
        head, marker, body = text.partition("[TOOL_CALLS]")
        if marker:
            calls = _mistral(body, names)
            content = head if calls else text
    else:
        raise ValueError(f"unknown tool call format {fmt!r}")
    content = content.strip()
    return (content or None) if calls else text, calls


def content_around_calls(text: str, fmt: str) -> str:
    """The text of an output with calls that is not a call, before stripping: what `parse` gives as
    content (hermes: the text around the call blocks; mistral: before the marker; llama3_json: none)."""
    if fmt == "hermes":
        return HERMES.sub("", text)
    if fmt == "mistral":
        return text.partition("[TOOL_CALLS]")[0]
    return ""


def _mistral(body: str, names: frozenset[str]) -> list[ToolCall]:
    body = body.strip()
    if body.startswith("["):
        values = _json_values(body)
        items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else None
        found = [_call(v, names, "arguments") for v in items or []]
        return [c for c in found if c is not None] if items and None not in found else []
    calls = []
    for piece in body.split("[TOOL_CALLS]"):
        name, marker, arguments = piece.partition("[ARGS]")
        call = _call({"name": name.strip(), "arguments": arguments.strip()}, names, "arguments") if marker else None
        if call is None:
            return []
        calls.append(call)
    return calls


def parse_forced(text: str, named: str | None, names: frozenset[str]) -> list[ToolCall]:
    """The calls of a grammar-forced output: the named function's arguments, or the array of calls."""
    if named is not None:
        try:
            arguments = json.loads(text)
        except json.JSONDecodeError:
            return []
        return [ToolCall(named, json.dumps(arguments, ensure_ascii=False))] if isinstance(arguments, dict) else []
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    found = [_call(v, names, "parameters") for v in items] if isinstance(items, list) else []
    return [c for c in found if c is not None] if found and None not in found else []


START_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
# the head of a forced call in the array the grammar makes: `[{"name": "f", "parameters": ` or, after
# a call, `}, {"name": "g", "parameters": ` (the schema fixes the property order)
FORCED_HEAD = re.compile(r'\s*\}?\s*[\[,]\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


class ArgumentScan:
    """Where a JSON value that streams in ends: depth of brackets outside strings, character by character."""

    __slots__ = ("depth", "escaped", "in_string", "started")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False

    def end(self, text: str, at: int) -> int | None:
        """Scan text from at; the index just past the value when it ends there, else None (all scanned)."""
        for i in range(at, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
                continue
            if c in "{[":
                self.depth += 1
            elif c in "}]":
                if self.depth == 0:
                    return i  # a scalar ended by its container
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif c == '"':
                self.in_string = True
            elif c == "," and self.depth == 0 and self.started:
                return i
            self.started = True
        return None


class ToolStream:
    """One choice's stream: text deltas become content deltas until a call begins, then tool_calls
    deltas as OpenAI sends them (the first of each call with its id and name, then its arguments)."""

    def __init__(self, fmt: str, names: frozenset[str], forced: bool, named: str | None, parallel: bool) -> None:
        self.fmt = fmt
        self.names = names
        self.forced = forced
        self.named = named
        self.parallel = parallel
        self.text = ""
        self.sent_content = 0  # characters of self.text handed out as content
        self.in_call = forced
        self.num_calls = 0
        self.named_id = ToolCall(named or "", "{}").id if named else ""
        self.scanned = 0  # forced array: characters of self.text read so far
        self.arguments: ArgumentScan | None = None  # forced array: the arguments being streamed

    @property
    def made_calls(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> list[dict]:
        """The deltas for new text of the choice."""
        self.text += text
        if self.named is not None:
            deltas = []
            if self.num_calls == 0:
                self.num_calls = 1
                deltas.append(
                    self._tool_delta(
                        0, {"id": self.named_id, "type": "function", "function": {"name": self.named, "arguments": ""}}
                    )
                )
            if text:
                deltas.append(self._tool_delta(0, {"function": {"arguments": text}}))
            return deltas
        if self.forced:
            return self._forced()
        if self.in_call:
            return []
        marker = START_MARKERS[self.fmt]
        start = self.text.find(marker, self.sent_content)
        if (
            start < 0
            and self.fmt == "llama3_json"
            and not self.text[: self.sent_content].strip()
            and self.text.lstrip().startswith("{")
        ):
            start = self.sent_content
        if start >= 0:
            self.in_call = True
            return self._content(start)
        # hold back what may be the beginning of a marker
        hold = next((k for k in range(min(len(marker), len(self.text)), 0, -1) if marker.startswith(self.text[-k:])), 0)
        if self.fmt == "llama3_json" and not self.text.strip():
            hold = len(self.text)
        return self._content(len(self.text) - hold)

    def _forced(self) -> list[dict]:
        """The forced array's calls as they are generated: a call's id and name once its name is
        complete, then its arguments in the pieces they arrive in."""
        deltas: list[dict] = []
        while True:
            if self.arguments is None:
                head = FORCED_HEAD.match(self.text, self.scanned)
                if head is None:
                    return deltas  # the head is not complete yet (or the array has ended)
                name = json.loads(head.group(1))
                if name not in self.names or (self.num_calls and not self.parallel):
                    return deltas  # not a call of an offered tool: the grammar rules this out
                deltas.append(
                    self._tool_delta(
                        self.num_calls,
                        {
                            "id": ToolCall(name, "{}").id,
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        },
                    )
                )
                self.num_calls += 1
                self.scanned = head.end()
                self.arguments = ArgumentScan()
            start = self.scanned
            if not self.arguments.started:  # the value's leading whitespace is no part of it
                while start < len(self.text) and self.text[start].isspace():
                    start += 1
            end = self.arguments.end(self.text, start)
            self.scanned = len(self.text) if end is None else end
            if self.scanned > start:
                deltas.append(
                    self._tool_delta(self.num_calls - 1, {"function": {"arguments": self.text[start : self.scanned]}})
                )
            if end is None:
                return deltas
            self.arguments = None

    def finish(self) -> list[dict]:
        """The deltas once the choice has ended: its calls, or the text held back as content."""
        if self.named is not None:
            return []
        if self.forced:  # the calls have streamed as they were generated; text that made none is content
            return [] if self.num_calls else self._content(len(self.text))
        content, calls = parse(self.text, self.fmt, self.names)
        if not calls:
            return self._content(len(self.text))
        deltas = []
        # the content is what the whole answer's would be: the text before the call (sent already as
        # it came) and the text after it
        around = content_around_calls(self.text, self.fmt)
        sent = self.text[: self.sent_content]
        if content and around.startswith(sent):
            rest = around[len(sent) :].rstrip()
            if not sent.strip():
                rest = rest.lstrip()
            if rest:
                deltas.append({"content": rest})
        for call in calls if self.parallel else calls[:1]:
            deltas.append(
                self._tool_delta(
                    self.num_calls,
                    {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
                )
            )
            deltas.append(self._tool_delta(self.num_calls, {"function": {"arguments": call.arguments}}))
            self.num_calls += 1
        return deltas

    def _content(self, upto: int) -> list[dict]:
        piece = self.text[self.sent_content : upto]
        self.sent_content = max(self.sent_content, upto)
        return [{"content": piece}] if piece else []

    @staticmethod
    def _tool_delta(index: int, call: dict) -> dict:
        return {"tool_calls": [{"index": index, **call}]}
