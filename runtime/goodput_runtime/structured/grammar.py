"""Grammars compiled once per distinct spec, and one matcher per choice that masks its next token.

The engine is llguidance (JSON Schema, regex, Lark and GBNF grammars, an Earley parser over a lazily
built lexer). bench/structured_output.py measures it against xgrammar, the engine before it, on
SmolLM2's 49,152-token vocabulary: llguidance compiles our schemas in 1-2 ms where xgrammar takes
0.2-0.4 s (its bounded repetitions, `maxLength` and `minItems`, are expensive to precompute), a
latency every request with a new schema would pay before its first token; both fill a step's mask
in tens of microseconds. This module is the only one that touches the engine. Compiled grammars are
cached by spec in a bounded LRU (a compiled grammar is a pristine matcher); each choice of a
request gets its own copy of it.

Masks are applied to the whole batch at once: one [rows, ceil(vocab / 32)] int32 bitmask, filled
on the CPU (one call per row, or one call for the batch on llguidance's thread pool), moved to the
logits' device and applied there branch-free (see apply_bitmask).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from goodput_runtime.structured.bitmask import allocate_bitmask, fill_row, fill_rows

if TYPE_CHECKING:  # a type in the stub only
    from llguidance._lib import JsonCompileOptions

CACHE_SIZE = 256  # compiled grammars kept
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural")
# JSON as json.dumps writes it (", " and ": ", no other whitespace); strict: a keyword the converter
# does not implement is an error, never ignored, and oneOf is not loosened to anyOf. These are
# overrides: a schema's own "x-guidance" settings cannot change them.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
    "coerce_one_of": False,
}
SOURCE_LINE = re.compile(r"^\s*[0-9]+ \| ")
POSITION = re.compile(r"^at [0-9]+\([0-9]+\): ")
PARALLEL_FILL_ROWS = 4  # from this many grammar rows a step fills their masks on the engine's threads


class GrammarError(ValueError):
    """A spec the engine cannot compile; the message names the construct."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request constrains its output to. source: a JSON Schema (as canonical JSON), a regex,
    a JSON list of choices, Lark or GBNF text; empty for json_object."""

    kind: str  # one of KINDS
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict) -> GrammarSpec:
        # key order kept: a schema's property order is its output's
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))


def _clean(message: str, keep_position: bool = False) -> str:
    """The engine's message on one line, without its echo of the source (a line and its ^ marker) and,
    unless kept, the position in the Lark text it made of the spec (a regex's, a schema's)."""
    lines = message.strip().splitlines()
    kept = []
    for i, line in enumerate(lines):
        marker = i + 1 < len(lines) and set(lines[i + 1].strip()) == {"^"}
        if marker or set(line.strip()) <= {"^"} or SOURCE_LINE.match(line):
            continue
        kept.append(line.strip())
    text = " ".join(kept)
    if not keep_position:
        text = POSITION.sub("", text)
    return text or "the engine refused it"


class Grammar:
    """One choice's matcher: which tokens may come next, advanced with each accepted token."""

    __slots__ = ("matcher", "words")

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self.matcher = matcher
        self.words = words  # int32 words of this tokenizer's mask: ceil(vocab / 32)

    def accept(self, token: int) -> bool:
        """Advance by one accepted token; False when the grammar refuses it (the choice then ends)."""
        return bool(self.matcher.consume_token(token))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if bitmask.shape[1] == self.words:
            fill_row(self.matcher, bitmask, row)
            return
        # logits wider (or narrower) than the tokenizer's vocabulary: tokens it lacks are never allowed
        own = allocate_bitmask(1, self.words * 32)
        fill_row(self.matcher, own, 0)
        width = min(self.words, bitmask.shape[1])
        bitmask[row, :width] = own[0, :width]
        bitmask[row, width:] = 0

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        """Nothing but the end may follow: the grammar is complete (or its end token was accepted)."""
        return bool(self.matcher.is_stopped())

    def fork(self) -> Grammar:
        return Grammar(self.matcher.deep_copy(), self.words)


class CompiledGrammar:
    """A compiled spec, shared by every request that asks for it; makes one matcher per choice."""

    __slots__ = ("pristine", "spec", "stop_token_ids", "words")

    def __init__(
        self, pristine: llguidance.LLMatcher, spec: GrammarSpec, stop_token_ids: list[int], words: int
    ) -> None:
        self.pristine = pristine  # never advanced: each choice's matcher is a copy of it
        self.spec = spec
        self.stop_token_ids = stop_token_ids
        self.words = words

    def matcher(self) -> Grammar:
        return Grammar(self.pristine.deep_copy(), self.words)


class GrammarCompiler:
    """Compiles specs against one tokenizer; thread-safe, with a bounded LRU of compiled grammars."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        cache_size: int = CACHE_SIZE,
        observe: Callable[[float], None] | None = None,
    ) -> None:
        self.stop_token_ids = sorted(stop_token_ids)
        self.vocab_size = vocab_size
        # a grammar ends on any of the model's end tokens (the tokenizer's own when it names none)
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=self.stop_token_ids or None
        )
        self.cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self.cache_size = cache_size
        self.lock = threading.Lock()
        self.observe = observe  # compile time in seconds, for the metrics
        self.num_compiled = 0

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar for spec, from the cache when it was compiled before; GrammarError when
        the engine cannot compile it."""
        with self.lock:
            found = self.cache.get(spec)
            if found is not None:
                self.cache.move_to_end(spec)
                return found
            start = time.perf_counter()
            compiled = CompiledGrammar(self._compile(spec), spec, self.stop_token_ids, (self.vocab_size + 31) // 32)
            if self.observe is not None:
                self.observe(time.perf_counter() - start)
            self.num_compiled += 1
            self.cache[spec] = compiled
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
            return compiled

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        grammar = to_llguidance(spec)
        keep = spec.kind == "grammar"  # a position in the client's own grammar helps; elsewhere it is ours
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_clean(matcher.get_error(), keep))
        # the lexer is built lazily: the first mask finishes compiling (and may still find an error)
        bitmask = allocate_bitmask(1, self.vocab_size)
        Grammar(matcher, bitmask.shape[1]).fill(bitmask, 0)
        if matcher.is_error():
            raise GrammarError(_clean(matcher.get_error(), keep))
        return matcher


def to_llguidance(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar (not yet checked: the matcher reports what is wrong)."""
    try:
        if spec.kind == "json_object":
            # OpenAI's JSON mode answers with an object, never another JSON value
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
        if spec.kind == "json_schema":
            schema = closed_objects(json.loads(spec.source))
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(choice_lark(json.loads(spec.source)))
        if spec.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(parse_grammar(spec.source))
        if spec.kind == "structural":
            return llguidance.LLMatcher.grammar_from_lark(structural_lark(json.loads(spec.source)))
    except GrammarError:
        raise
    except Exception as exc:  # the converters raise ValueError (and others) for input they cannot read
        raise GrammarError(_clean(str(exc))) from None
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


# where subschemas are: maps of names to subschemas, and keywords holding one subschema or a list of them
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMA_VALUES = ("items", "additionalProperties", "additionalItems")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """schema with its objects closed, as OpenAI's strict mode has them: an object schema that lists
    properties admits no others unless it says so (additionalProperties). JSON Schema admits any
    other property by default, which a model fills with made-up keys until max_tokens. Outputs stay
    valid against the schema as sent (only the extra properties are ruled out). Schemas whose objects
    merge (allOf, a $ref beside properties) stay as they are: closing one part would rule out the
    other's properties."""
    if not isinstance(schema, dict) or _merges(schema):
        return schema
    return _close(schema)


def _merges(schema: Any) -> bool:
    if isinstance(schema, list):
        return any(_merges(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    if "allOf" in schema or ("$ref" in schema and "properties" in schema):
        return True
    return any(_merges(value) for value in schema.values() if isinstance(value, dict | list))


def _close(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for keyword in SUBSCHEMA_MAPS:
        if isinstance(out.get(keyword), dict):
            out[keyword] = {name: _close(sub) for name, sub in out[keyword].items()}
    for keyword in SUBSCHEMA_VALUES:
        if isinstance(out.get(keyword), dict):
            out[keyword] = _close(out[keyword])
    for keyword in SUBSCHEMA_LISTS:
        if isinstance(out.get(keyword), list):
            out[keyword] = [_close(sub) for sub in out[keyword]]
    properties = out.get("properties")
    required = out.get("required", [])
    if (
        isinstance(properties, dict)
        and not any(k in out for k in OPEN_KEYWORDS)
        and isinstance(required, list)
        and all(name in properties for name in required)
    ):
        out["additionalProperties"] = False
    return out


def lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def choice_lark(choices: list[str]) -> str:
    return "start: " + " | ".join(lark_string(c) for c in choices)


def parse_grammar(text: str) -> str:
    """Lark (with a start rule) as it is, or GBNF/EBNF (with a root rule) converted to Lark."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as exc:  # the converter raises plain Exception for a rule it cannot resolve
        raise GrammarError(f"not Lark (no 'start' rule), and as EBNF: {_clean(str(exc))}") from None


def structural_lark(parts: list[dict]) -> str:
    """Literal text and JSON Schemas in sequence: [{"text": ...} | {"schema": {...}}, ...]."""
    rules, names = [], []
    for i, part in enumerate(parts):
        names.append(f"part{i}")
        if "text" in part:
            rules.append(f"part{i}: {lark_string(part['text'])}")
        else:
            options = {
                k: v
                for k, v in JSON_OPTIONS.items()
                if k in ("whitespace_flexible", "item_separator", "key_separator", "lenient")
            }
            schema = {**closed_objects(part["schema"]), "x-guidance": options}
            rules.append(f"part{i}: %json {json.dumps(schema)}")
    return "\n".join([f"start: {' '.join(names)}", *rules])


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def fill_bitmasks(rows: list[tuple[Grammar, int]], bitmask: torch.Tensor) -> None:
    """Each (grammar, row)'s mask into its row of bitmask: one call per row for a few rows, else one
    call that fills them all on llguidance's thread pool (the GIL released throughout)."""
    global _executor
    if len(rows) < PARALLEL_FILL_ROWS or any(g.words != bitmask.shape[1] for g, _ in rows):
        for grammar, row in rows:
            grammar.fill(bitmask, row)
        return
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
    fill_rows(_executor, [(g.matcher, row) for g, row in rows], bitmask)


BIAS_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _bias_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each byte of a mask, what to add to its 8 tokens' logits (0 allowed, -inf not)."""
    table = BIAS_TABLES.get((device, dtype))
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = torch.where(bits.bool(), 0.0, float("-inf")).to(device=device, dtype=dtype)
        BIAS_TABLES[(device, dtype)] = table
    return table


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Masked-out tokens of the listed rows become -inf, in place, on the logits' device.
    bitmask: [len(logits), ceil(V / 32)] int32, one bit per token, 1 where the token is allowed.

    Branch-free: a masked_fill with a bool mask costs about 5x more on CPU (its per-element branch
    mispredicts on a mask's irregular pattern). On CPU the bits are unpacked into an additive bias
    (0 or -inf, made by integer operations on the float's bits) with numpy, on the calling thread:
    torch's parallel operations wait on their slowest thread, which on a busy machine costs
    milliseconds. Elsewhere each mask byte looks up its 8 tokens' bias. bench/structured_output.py
    measures this against xgrammar's kernel."""
    if not rows:
        return
    everyone = rows == list(range(logits.shape[0]))
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        _apply_cpu(logits, bitmask, rows, everyone)
        return
    device = logits.device
    words = bitmask.to(device, non_blocking=True)
    index = None if everyone else torch.tensor(rows, device=device)
    if index is not None:
        words = words.index_select(0, index)
    table = _bias_table(device, logits.dtype)
    bias = table.index_select(0, words.contiguous().view(torch.uint8).reshape(-1).long()).reshape(len(rows), -1)
    vocab = logits.shape[-1]
    if bias.shape[1] < vocab:  # tokens past the mask are never allowed
        bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=float("-inf"))
    bias = bias[:, :vocab]
    if index is None:
        logits.add_(bias)
    else:
        logits.index_add_(0, index, bias)


NEG_INF_BITS = np.int32(-8388608)  # 0xFF800000: the bits of float32 -inf


def _apply_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], everyone: bool) -> None:
    words = bitmask.numpy() if everyone else bitmask.numpy()[rows]
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=1, bitorder="little")
    vocab = logits.shape[-1]
    width = min(bits.shape[1], vocab)
    # allowed (1) -> 0 -> bits 0x00000000 (0.0); ruled out (0) -> -1 -> 0xFF800000 (-inf)
    bias = ((bits[:, :width].astype(np.int32) - 1) & NEG_INF_BITS).view(np.float32)
    target = logits.detach().numpy()
    if everyone:
        target[:, :width] += bias
        target[:, width:] = -np.inf  # tokens past the mask are never allowed
    else:
        target[rows, :width] += bias
        target[np.ix_(rows, range(width, vocab))] = -np.inf
