"""Grammars compiled once per distinct spec, and one matcher per choice that masks its next token.

The engine is xgrammar (JSON Schema, regex, EBNF and Lark, grammars concatenated, masks applied in
place on CPU or GPU). bench/structured_output.py measures it against llguidance on SmolLM2's
49,152-token vocabulary: both fill a step's mask in tens of microseconds, small beside a forward
pass; xgrammar compiles a bounded string (`maxLength`) slowly (about 0.1-0.5 s of CPU), which the
cache pays once per schema, off the event loop. This module is the only one that touches the
engine. Compiled grammars are cached by spec in a bounded LRU; a matcher is cheap, so each choice
of a request gets its own.

Masks are applied to the whole batch at once: one [rows, ceil(vocab / 32)] int32 bitmask, filled
on the CPU row by row (a C++ call each), moved to the logits' device and applied there in one call.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

CACHE_SIZE = 256  # compiled grammars kept; each is a few hundred KiB at most for JSON schemas
CPP_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:[0-9]+: ")
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural")


class GrammarError(ValueError):
    """A spec the engine cannot compile; the message names the construct."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request constrains its output to. source: a JSON Schema (as canonical JSON), a regex,
    a JSON list of choices, EBNF or Lark text; empty for json_object."""

    kind: str  # one of KINDS
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict) -> GrammarSpec:
        # key order kept: a schema's property order is its output's
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))


def _clean(exc: Exception) -> str:
    return CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))


class Grammar:
    """One choice's matcher: which tokens may come next, advanced with each accepted token."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance by one accepted token; False when the grammar refuses it (then it stays where it was)."""
        return bool(self.matcher.accept_token(token))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return bool(self.matcher.is_terminated())

    def fork(self) -> Grammar:
        return Grammar(self.matcher.fork())


class CompiledGrammar:
    """A compiled spec, shared by every request that asks for it; makes one matcher per choice."""

    __slots__ = ("compiled", "spec", "stop_token_ids")

    def __init__(self, compiled: xgr.CompiledGrammar, spec: GrammarSpec, stop_token_ids: list[int]) -> None:
        self.compiled = compiled
        self.spec = spec
        self.stop_token_ids = stop_token_ids

    def matcher(self) -> Grammar:
        # max_rollback_tokens=-1: a matcher may be rolled back by any number of tokens
        return Grammar(xgr.GrammarMatcher(self.compiled, override_stop_tokens=self.stop_token_ids or None))


class GrammarCompiler:
    """Compiles specs against one tokenizer; thread-safe, with a bounded LRU of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 cache_size: int = CACHE_SIZE, observe: Callable[[float], None] | None = None) -> None:
        self.stop_token_ids = sorted(stop_token_ids)
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.stop_token_ids or None)
        # xgrammar's own cache is off: ours is bounded by count and shared with the kinds it lacks
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
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
            compiled = CompiledGrammar(self._compile(spec), spec, self.stop_token_ids)
            if self.observe is not None:
                self.observe(time.perf_counter() - start)
            self.num_compiled += 1
            self.cache[spec] = compiled
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
            return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json_object":
                # OpenAI's JSON mode answers with an object (the builtin JSON grammar admits any value)
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                         strict_mode=False)
            if spec.kind == "json_schema":
                return self.compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.source)
            if spec.kind == "choice":
                choices = json.loads(spec.source)
                return self.compiler.compile_grammar(choice_ebnf(choices))
            if spec.kind == "grammar":
                return self.compiler.compile_grammar(parse_grammar(spec.source))
            if spec.kind == "structural":
                return self.compiler.compile_grammar(structural_grammar(json.loads(spec.source)))
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar reports every construct it cannot handle as RuntimeError
            raise GrammarError(_clean(exc)) from None
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def parse_grammar(text: str) -> xgr.Grammar:
    """EBNF (GBNF, with a root rule) or Lark (with a start rule); the first that parses."""
    try:
        return xgr.Grammar.from_ebnf(text)
    except Exception as ebnf_error:
        try:
            return xgr.Grammar.from_lark(text)
        except Exception as lark_error:
            raise GrammarError(f"neither EBNF ({_clean(ebnf_error)}) nor Lark ({_clean(lark_error)})") from None


def structural_grammar(parts: list[dict]) -> xgr.Grammar:
    """Literal text and JSON Schemas in sequence: [{"text": ...} | {"schema": {...}}, ...]."""
    grammars = []
    for part in parts:
        if "text" in part:
            grammars.append(xgr.Grammar.from_ebnf("root ::= " + json.dumps(part["text"], ensure_ascii=False)))
        else:
            grammars.append(xgr.Grammar.from_json_schema(json.dumps(part["schema"]), any_whitespace=False,
                                                         strict_mode=True))
    return xgr.Grammar.concat(*grammars)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Masked-out tokens of the listed rows become -inf, in place, on the logits' device.
    bitmask: [len(rows), ceil(V / 32)] int32, one bit per token, 1 where the token is allowed."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
