"""Grammars in the engine: every choice follows its grammar to the end, through n > 1, preemption
with recompute and stop strings, while requests without one in the same batch are untouched."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_engine_choices import config, run

from goodput_runtime.engine.builder import build_core
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.structured.grammar import GrammarCompiler, GrammarError, GrammarSpec
from goodput_runtime.structured.schema import check_schema

RECORD = r'\{"id": [1-9][0-9]{0,2}, "ok": (true|false), "tag": "[a-z]{2,6}"\}'
PROMPT = list(range(20, 60))


def compiler_for(core) -> GrammarCompiler:
    return GrammarCompiler(core.tokenizer, core.runner.model.config.vocab_size, core.scheduler.eos_token_ids)


def texts(core, results) -> dict:
    return {
        key: (core.tokenizer.decode(r["tokens"], skip_special_tokens=True), r["reason"]) for key, r in results.items()
    }


def test_every_choice_matches_its_regex_through_preemption_while_plain_requests_are_untouched(tiny_model_dir: Path):
    # too few blocks for every choice at once: choices get preempted and recomputed
    core = build_core(config(tiny_model_dir, blocks=14, block_size=8, max_model_len=112))
    grammar = compiler_for(core).compile(GrammarSpec("regex", RECORD))
    plain = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    requests = {
        f"g{i}": (PROMPT[i:], SamplingParams(max_tokens=60, temperature=1.0, seed=i, n=3, grammar=grammar))
        for i in range(3)
    }
    requests["plain"] = (PROMPT, plain)
    preempted = []
    schedule = core.scheduler.schedule
    core.scheduler.schedule = lambda: (out := schedule(), preempted.append(out.num_preempted))[0]  # type: ignore
    results, _ = run(core, requests)
    outputs = texts(core, results)
    for i in range(3):
        for choice in range(3):
            text, reason = outputs[(f"g{i}", choice)]
            assert re.fullmatch(RECORD, text), text
            assert reason == "stop"
    alone, _ = run(build_core(config(tiny_model_dir)), {"plain": (PROMPT, plain)})
    assert results[("plain", 0)]["tokens"] == alone[("plain", 0)]["tokens"]
    assert sum(preempted) > 0  # the case under test happened


def test_a_cut_output_ends_with_length_and_a_stop_string_ends_it_early(tiny_model_dir: Path):
    core = build_core(config(tiny_model_dir))
    grammar = compiler_for(core).compile(GrammarSpec("regex", RECORD))
    results, _ = run(
        core,
        {
            "cut": (PROMPT, SamplingParams(max_tokens=4, temperature=0.0, grammar=grammar)),
            "stopped": (PROMPT, SamplingParams(max_tokens=60, temperature=0.0, grammar=grammar, stop=('"ok"',))),
        },
    )
    outputs = texts(core, results)
    text, reason = outputs[("cut", 0)]
    assert reason == "length" and len(results[("cut", 0)]["tokens"]) == 4 and text.startswith('{"id')
    assert outputs[("stopped", 0)][1] == "stop"
    # the engine's tokens run to the token completing the stop string (the server's text ends before it);
    # that token may carry characters past the stop string (`":` is one token), so the text up to the
    # stop string follows the grammar and the tokens before the last do not hold the stop string yet
    stopped = outputs[("stopped", 0)][0]
    end = stopped.find('"ok"') + len('"ok"')
    assert end >= len('"ok"') and re.fullmatch(r'\{"id": [1-9][0-9]{0,2}, "ok"', stopped[:end]), stopped
    before = core.tokenizer.decode(results[("stopped", 0)]["tokens"][:-1], skip_special_tokens=True)
    assert '"ok"' not in before, stopped


def test_a_json_schema_with_enums_and_bounded_values_is_followed_by_a_random_model(tiny_model_dir: Path):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "minimum": 1, "maximum": 9},
            "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
            "inner": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
        },
        "required": ["color", "size", "flags", "inner"],
    }
    core = build_core(config(tiny_model_dir))
    grammar = compiler_for(core).compile(GrammarSpec.json_schema(schema))
    results, _ = run(
        core, {"a": (PROMPT, SamplingParams(max_tokens=120, temperature=1.0, seed=3, n=4, grammar=grammar))}
    )
    for choice in range(4):
        text, reason = texts(core, results)[("a", choice)]
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_the_compiler_caches_per_spec_within_its_bound_and_names_what_it_cannot_compile(tiny_model_dir: Path):
    core = build_core(config(tiny_model_dir))
    seen: list[float] = []
    compiler = GrammarCompiler(
        core.tokenizer,
        core.runner.model.config.vocab_size,
        core.scheduler.eos_token_ids,
        cache_size=2,
        observe=seen.append,
    )
    first = compiler.compile(GrammarSpec("regex", "[ab]+"))
    assert compiler.compile(GrammarSpec("regex", "[ab]+")) is first
    compiler.compile(GrammarSpec("regex", "c"))
    compiler.compile(GrammarSpec("regex", "d"))
    assert compiler.compile(GrammarSpec("regex", "[ab]+")) is not first  # evicted, compiled again
    assert len(seen) == 4 and len(compiler.cache) == 2
    with pytest.raises(GrammarError, match="look-behind, is not supported"):
        compiler.compile(GrammarSpec("regex", "(?<=a)b"))
    with pytest.raises(GrammarError, match="Rule 'nowhere' not found"):
        compiler.compile(GrammarSpec("grammar", "root ::= nowhere"))
    with pytest.raises(GrammarError, match='unknown name: "nowhere"'):
        compiler.compile(GrammarSpec("grammar", "start: nowhere"))


# what llguidance refuses itself: each keyword it does not implement is a compile error naming it
@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, 'Unimplemented keys: ["not"]'),
        ({"type": "array", "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
        ({"type": "array", "contains": {"const": 1}}, 'Unimplemented keys: ["contains"]'),
        (
            {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
            'Unimplemented keys: ["if", "then"]',
        ),
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, 'Unimplemented keys: ["propertyNames"]'),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, 'Unimplemented keys: ["dependentRequired"]'),
        (
            {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
            'Unimplemented keys: ["unevaluatedProperties"]',
        ),
        ({"type": "string", "format": "uri-reference"}, "Unknown format: uri-reference"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf constraints are not supported"),
        ({"type": "string", "pattern": "(?=a)a"}, "look-around"),
    ],
)
def test_a_keyword_the_engine_does_not_implement_fails_to_compile_naming_it(tiny_model_dir: Path, schema, named):
    core = build_core(config(tiny_model_dir))
    check_schema(schema)  # valid JSON Schema: the engine itself refuses it
    with pytest.raises(GrammarError, match=re.escape(named)):
        compiler_for(core).compile(GrammarSpec.json_schema(schema))


# what llguidance would accept and not enforce is refused before it gets there
@pytest.mark.parametrize(
    ("schema", "named"),
    [
        (
            {"type": "object", "properties": {"a": {"type": "string", "contentEncoding": "base64"}}},
            "'contentEncoding' at '#/properties/a'",
        ),
        ({"type": "string", "contentMediaType": "application/json"}, "'contentMediaType' at '#'"),
        (
            {
                "type": "array",
                "items": {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": {"type": "object"},
                },
            },
            "'contentMediaType' at '#/items'",
        ),
        ({"x-guidance": {"lenient": True}, "type": "array", "uniqueItems": True}, "'x-guidance' at '#'"),
        ({"type": "strin"}, "not a valid JSON Schema"),
    ],
)
def test_a_keyword_the_engine_would_ignore_is_refused_naming_the_construct(schema, named):
    with pytest.raises(GrammarError, match=re.escape(named)):
        check_schema(schema)


def test_the_engine_ignores_the_keywords_refused_before_it(tiny_model_dir: Path):
    """Why they are refused: compiled, a string that is not base64 gets through (were this to fail,
    the engine enforces contentEncoding now and the refusal can go)."""
    core = build_core(config(tiny_model_dir))
    matcher = (
        compiler_for(core).compile(GrammarSpec.json_schema({"type": "string", "contentEncoding": "base64"})).matcher()
    )
    ids = core.tokenizer('"!!"', add_special_tokens=False).input_ids
    assert all(matcher.accept(t) for t in ids)


@pytest.mark.parametrize("dtype", ["float32", "float64"])  # numpy's path on CPU; the lookup table's elsewhere
def test_the_mask_rules_out_exactly_the_unset_bits_of_the_listed_rows(dtype):
    import torch

    from goodput_runtime.structured.grammar import allocate_bitmask, apply_bitmask

    vocab = 100
    bitmask = allocate_bitmask(3, vocab)  # every token allowed
    bitmask[0, :] = 0
    bitmask[0, 1] = 1 << 5  # row 0: only token 37
    bitmask[2, 0] = ~(1 << 3)  # row 2: all but token 3 (and nothing past the mask's 96 + 32 bits is cut)
    logits = torch.zeros(3, vocab, dtype=getattr(torch, dtype))
    apply_bitmask(logits, bitmask, [0, 2])
    assert (logits[0] == 0).nonzero().flatten().tolist() == [37]
    assert (logits[1] == 0).all()  # not listed: untouched
    assert (logits[2] != 0).nonzero().flatten().tolist() == [3]
    wide = torch.zeros(2, 40, dtype=getattr(torch, dtype))
    apply_bitmask(wide, allocate_bitmask(2, 32), [0])  # tokens past the mask are never allowed
    assert torch.isinf(wide[0, 32:]).all() and (wide[0, :32] == 0).all() and (wide[1] == 0).all()


def test_objects_that_list_their_properties_admit_no_others_unless_the_schema_says_so(tiny_model_dir: Path):
    core = build_core(config(tiny_model_dir))
    compiler = compiler_for(core)

    def admits(schema: dict, value: object) -> bool:
        matcher = compiler.compile(GrammarSpec.json_schema(schema)).matcher()
        ids = core.tokenizer(json.dumps(value), add_special_tokens=False).input_ids
        return all(matcher.accept(t) for t in ids) and matcher.matcher.is_accepting()

    listed = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert admits(listed, {"a": 1}) and not admits(listed, {"a": 1, "b": 2})
    assert admits({**listed, "additionalProperties": {"type": "integer"}}, {"a": 1, "b": 2})
    assert admits({"type": "object"}, {"b": 2})  # lists none: any object
    # merged objects stay open: closing one part would rule out the other's properties
    merged = {"allOf": [listed, {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert admits(merged, {"a": 1, "b": 2})
