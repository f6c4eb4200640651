"""InferenceService specs drawn from the CRD's own openAPI schema (hypothesis strategies).

Every drawn spec is one the API server admits: types, enums, bounds, patterns and required
fields come from the schema, and `with_defaults` fills in the schema's defaults as the server
does before the operator sees the object. Free-form parts (`x-kubernetes-preserve-unknown-fields`)
are drawn from small pools that include what the operator must refuse (a hostPath volume, an
API key in the pod's environment).
"""

from __future__ import annotations

import copy
import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

CRD_PATH = Path(__file__).resolve().parents[1] / "crds" / "serving.goodput.dev_inferenceservices.yaml"
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
NAMES = st.from_regex(r"[a-z]([-a-z0-9]{0,14}[a-z0-9])?", fullmatch=True)
LABEL_KEYS = st.from_regex(r"[a-z][a-z0-9]{0,8}(\.[a-z]{2,4}/[a-z][a-z0-9]{0,8})?", fullmatch=True)

# free-form objects under spec.template, by schema path
VOLUMES = st.builds(
    lambda name, kind: {"name": name, kind: {"path": "/x"} if kind == "hostPath" else {}},
    NAMES,
    st.sampled_from(["emptyDir", "configMap", "secret", "hostPath", "projected"]),
)
ENV = st.builds(
    lambda name, value: {"name": name, "value": value},
    st.sampled_from(["FOO", "GOODPUT_API_KEY", "LOG_LEVEL", "VLLM_API_KEY"]),
    TEXT,
)
FREE_FORM = {
    "spec.template.volumes[]": VOLUMES,
    "spec.template.env[]": ENV,
    "spec.template.volumeMounts[]": st.builds(lambda n: {"name": n, "mountPath": f"/mnt/{n}"}, NAMES),
    "spec.template.tolerations[]": st.just({"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}),
    "spec.template.affinity": st.just({}),
}


@cache
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def spec_schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _pattern(schema: dict[str, Any]) -> st.SearchStrategy[str]:
    pattern = schema["pattern"]
    body = st.from_regex(
        re.compile(pattern), fullmatch=True, alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"))
    )
    low, high = schema.get("minLength", 0), schema.get("maxLength", 10**6)
    return body.filter(lambda s: low <= len(s) <= high)


def strategy(schema: dict[str, Any], path: str = "spec") -> st.SearchStrategy[Any]:
    """Values the schema at `path` admits."""
    if path in FREE_FORM:
        return FREE_FORM[path]
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if schema.get("x-kubernetes-int-or-string"):
        text = _pattern(schema) if "pattern" in schema else TEXT
        return st.one_of(st.integers(0, 10**12), text)
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties") or {}
        if not props:
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict):
                return st.dictionaries(LABEL_KEYS, strategy(extra, path + "{}"), max_size=2)
            return st.just({})
        required = set(schema.get("required") or ())
        return st.fixed_dictionaries(
            {k: strategy(v, f"{path}.{k}") for k, v in props.items() if k in required},
            optional={k: strategy(v, f"{path}.{k}") for k, v in props.items() if k not in required},
        )
    if kind == "array":
        return st.lists(
            strategy(schema["items"], path + "[]"),
            min_size=schema.get("minItems", 0),
            max_size=min(schema.get("maxItems", 2), 2),
        )
    if kind == "string":
        if "pattern" in schema:
            return _pattern(schema)
        low = schema.get("minLength", 0)
        return st.text(
            st.characters(codec="utf-8", exclude_categories=("Cs",)),
            min_size=low,
            max_size=max(low, schema.get("maxLength", 12)),
        )
    if kind == "integer":
        return st.integers(schema.get("minimum", -(2**31)), schema.get("maximum", 2**31))
    if kind == "number":
        low, high = schema.get("minimum", -1e9), schema.get("maximum", 1e9)
        floats = st.floats(
            low,
            high,
            allow_nan=False,
            allow_infinity=False,
            exclude_min=bool(schema.get("exclusiveMinimum")),
            exclude_max=bool(schema.get("exclusiveMaximum")),
        )
        return floats.map(lambda x: round(x, 6)).filter(
            lambda x: (x > low if schema.get("exclusiveMinimum") else x >= low) and x <= high
        )
    if kind == "boolean":
        return st.booleans()
    raise AssertionError(f"{path}: no strategy for {schema}")


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The value with the schema's defaults filled in, as the API server's structural defaulting does."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and schema.get("type") == "object":
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = with_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [with_defaults(schema["items"], item) for item in value]
    return value


def specs() -> st.SearchStrategy[dict[str, Any]]:
    """Specs the CRD admits, as the operator reads them (defaults applied)."""
    schema = spec_schema()
    return strategy(schema).map(lambda spec: with_defaults(schema, spec))


def schema_at(field_path: str) -> dict[str, Any] | None:
    """The schema of a dotted field path such as spec.template.volumes[1] or spec.slo.ttft, else None."""
    parts = [p for p in re.split(r"\.|\[[^\]]*\]", field_path) if p]
    if not parts or parts[0] != "spec":
        return None
    schema: dict[str, Any] | None = spec_schema()
    for part in parts[1:]:
        while schema is not None and schema.get("type") == "array":
            schema = schema["items"]
        schema = ((schema or {}).get("properties") or {}).get(part)
        if schema is None:
            return None
    return schema
