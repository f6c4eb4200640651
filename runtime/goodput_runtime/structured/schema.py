"""JSON Schemas as the grammar engine can enforce them.

llguidance is strict: a keyword its JSON Schema converter does not implement (`not`, `if`/`then`/
`else`, `uniqueItems`, `contains`, `propertyNames`, `dependent*`, `unevaluated*`, `$dynamicRef`,
an unknown `format`, an overlapping `oneOf`, ...) is a compile error, which the server returns as a
400 naming the field and the keyword. What it would accept and not enforce is refused here, naming
the keyword and where it is: the `content*` keywords (annotations to the converter, so a string
declared base64 or JSON would not be held to it), and a top-level `x-guidance`, the engine's own
settings (one of them, `lenient`, makes it ignore what it cannot enforce). Every output a request
gets therefore validates against its schema."""

from __future__ import annotations

from typing import Any

import jsonschema

from goodput_runtime.structured.grammar import GrammarError

# keywords llguidance accepts but does not enforce (checked by compiling a schema with each and
# replaying an instance that violates it)
UNENFORCED = ("contentEncoding", "contentMediaType", "contentSchema")
# keywords whose value is a map of names to subschemas, and those holding one subschema or a list of them
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_VALUES = (
    "items",
    "additionalProperties",
    "unevaluatedProperties",
    "additionalItems",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
)
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def check_schema(schema: Any) -> None:
    """GrammarError naming the construct when schema is no valid JSON Schema or holds a keyword the
    engine would accept without enforcing it."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON Schema must be an object")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise GrammarError(f"not a valid JSON Schema at '#/{where}': {exc.message}") from None
    if "x-guidance" in schema:
        raise GrammarError(
            "the keyword 'x-guidance' at '#' is not supported: it sets the grammar engine's options, "
            "which the server fixes"
        )
    _walk(schema, "#")


def _walk(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        return
    for keyword in UNENFORCED:
        if keyword in schema:
            raise GrammarError(
                f"the keyword '{keyword}' at '{where}' is not supported: the grammar engine cannot enforce it"
            )
    for keyword in SCHEMA_MAPS:
        value = schema.get(keyword)
        if isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, f"{where}/{keyword}/{name}")
    for keyword in SCHEMA_VALUES:
        _walk(schema.get(keyword), f"{where}/{keyword}")
    for keyword in SCHEMA_LISTS:
        value = schema.get(keyword)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                _walk(sub, f"{where}/{keyword}/{i}")
