"""JSON Schemas as the grammar engine can enforce them: a schema it would silently ignore part of is
refused, naming the keyword, so that every output a request gets validates against its schema."""

from __future__ import annotations

from typing import Any

import jsonschema

from goodput_runtime.structured.grammar import GrammarError

# keywords xgrammar accepts but does not enforce (checked against its converted grammar)
UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
              "propertyNames", "uniqueItems", "contains", "minContains", "maxContains", "unevaluatedItems")
# keywords whose value is a map of names to subschemas, and those holding one subschema or a list of them
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties", "additionalItems")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def check_schema(schema: Any) -> None:
    """GrammarError naming the construct when schema is no valid JSON Schema or holds a keyword the
    engine cannot enforce."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON Schema must be an object")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise GrammarError(f"not a valid JSON Schema at '#/{where}': {exc.message}") from None
    _walk(schema, "#")


def _walk(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        return
    for keyword in UNENFORCED:
        if keyword in schema:
            raise GrammarError(f"the keyword '{keyword}' at '{where}' is not supported: the grammar engine "
                               "cannot enforce it")
    if "unevaluatedProperties" in schema and schema["unevaluatedProperties"] is not False:
        raise GrammarError(f"the keyword 'unevaluatedProperties' at '{where}' is supported only as false")
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
