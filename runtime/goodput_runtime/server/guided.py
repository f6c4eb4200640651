"""Grammars for requests that constrain their output: compiled on a thread of their own (never on
the event loop), cached per distinct spec, and handed to the engine with the request's settings."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

from goodput_runtime.engine.client import EngineClient
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.server.errors import invalid
from goodput_runtime.server.generate import ToolSetup
from goodput_runtime.server.protocol import ChatRequest, Guide
from goodput_runtime.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarError
from goodput_runtime.structured.tool_parsers import parser_for_template


class Grammars:
    """The server's grammar compiler, made on first use for the engine's tokenizer and vocabulary."""

    def __init__(self, metrics: RuntimeMetrics | None = None, tool_call_parser: str | None = None) -> None:
        self.metrics = metrics
        self.tool_call_parser = tool_call_parser  # None: the one the chat template implies
        self.compiler: GrammarCompiler | None = None
        self.lock = threading.Lock()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def _compiler(self, engine: EngineClient) -> GrammarCompiler:
        with self.lock:
            if self.compiler is None:
                observe = self.metrics.grammar_compile.observe if self.metrics is not None else None
                self.compiler = GrammarCompiler(
                    engine.tokenizer, engine.vocab_size, engine.eos_token_ids, observe=observe
                )
            return self.compiler

    def _compile(self, engine: EngineClient, guide: Guide) -> CompiledGrammar:
        return self._compiler(engine).compile(guide.spec)

    async def params(self, engine: EngineClient, guide: Guide | None, params: SamplingParams) -> SamplingParams:
        """params with the request's compiled grammar; a 400 naming the field when it cannot compile."""
        if guide is None:
            return params
        if params.min_tokens > 0:
            # a grammar may complete before min_tokens, and then nothing but the end may follow
            raise invalid(
                f"'min_tokens' cannot be combined with '{guide.param}': the output ends when its grammar "
                "completes, which may be before min_tokens",
                "min_tokens",
                "unsupported_parameter",
            )
        loop = asyncio.get_running_loop()
        try:
            compiled = await loop.run_in_executor(self.executor, self._compile, engine, guide)
        except GrammarError as exc:
            raise invalid(f"'{guide.param}' cannot be enforced: {exc}", guide.param, "unsupported_grammar") from None
        if self.metrics is not None:
            self.metrics.record_structured(guide.kind)
        return dataclasses.replace(params, grammar=compiled)

    def tools(self, engine: EngineClient, body: ChatRequest) -> ToolSetup | None:
        """How the request's output turns into tool calls; None when it offers no tools or forbids calls."""
        if not body.tools or body.tool_choice == "none":
            return None
        fmt = self.tool_call_parser or parser_for_template(getattr(engine.tokenizer, "chat_template", None))
        named = body.tool_choice if body.forced_tool and body.tool_choice != "required" else None
        return ToolSetup(fmt, frozenset(t.name for t in body.tools), body.forced_tool, named, body.parallel_tool_calls)

    def close(self) -> None:
        self.executor.shutdown(wait=False)
