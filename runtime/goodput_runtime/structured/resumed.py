"""A grammar taken up part way: a stream continued on another replica names the output it had produced
(`resume_output_ids`), and its grammar goes on from where that output left it rather than from the start."""

from __future__ import annotations

from collections.abc import Sequence

from goodput_runtime.structured.grammar import CompiledGrammar, Grammar


def advanced(compiled: CompiledGrammar, tokens: Sequence[int]) -> CompiledGrammar | None:
    """`compiled` after `tokens`, earlier output of the request: each choice's matcher is a copy of this
    state. None where the grammar refuses one of the tokens, or is complete before the last of them."""
    grammar = Grammar(compiled.pristine.deep_copy(), compiled.words)
    for token in tokens:
        if grammar.terminated or not grammar.accept(token):  # a complete grammar takes nothing more
            return None
    return CompiledGrammar(grammar.matcher, compiled.spec, compiled.stop_token_ids, compiled.words)
