"""The tenant table: each tenant's name, API keys, limits, priority class, weight and SLO targets, parsed
from the YAML a Secret or a file holds."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import yaml

PRIORITIES = {"critical": 0, "standard": 1, "sheddable": 2}
ANONYMOUS = "anonymous"
LIMIT_FIELDS = {"requestsPerMinute", "tokensPerMinute", "concurrency"}


@dataclass(frozen=True)
class Tenant:
    name: str
    keys: tuple[str, ...] = ()
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrency: int | None = None
    priority: str = "standard"
    weight: float = 1.0
    slo_ttft: float | None = None  # seconds: the tenant's default targets, before the service's
    slo_tpot: float | None = None


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_table(text: str, where: str) -> dict[str, Tenant]:
    """`tenants:` mapping names to {keys, requestsPerMinute, tokensPerMinute, concurrency, priority, weight}."""
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), dict):
        raise ValueError(f"{where}: expected a mapping 'tenants: {{name: {{keys: [...], ...}}}}'")
    tenants = {}
    seen: dict[str, str] = {}
    for name, spec in doc["tenants"].items():
        at = f"{where}: tenants.{name}"
        if not isinstance(spec, dict):
            raise ValueError(f"{at}: expected a mapping")
        for key in spec:
            if key not in {*LIMIT_FIELDS, "keys", "priority", "weight", "slo"}:
                raise ValueError(f"{at}.{key}: unknown field")
        keys = spec.get("keys") or []
        if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"{at}.keys: expected a list of non-empty strings")
        for k in keys:
            if digest(k) in seen:
                raise ValueError(f"{at}.keys: a key of tenant {seen[digest(k)]} too")
            seen[digest(k)] = str(name)
        limits = {}
        for field_name in LIMIT_FIELDS:
            value = spec.get(field_name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{at}.{field_name}: expected a positive integer")
            limits[field_name] = value
        priority = spec.get("priority", "standard")
        if priority not in PRIORITIES:
            raise ValueError(f"{at}.priority: expected one of {', '.join(PRIORITIES)}")
        weight = spec.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"{at}.weight: expected a positive number")
        slo = spec.get("slo") or {}
        if not isinstance(slo, dict) or set(slo) - {"ttftMs", "tpotMs"}:
            raise ValueError(f"{at}.slo: expected {{ttftMs: N, tpotMs: N}}")
        for target in slo.values():
            if isinstance(target, bool) or not isinstance(target, (int, float)) or not target > 0:
                raise ValueError(f"{at}.slo: targets are positive numbers of milliseconds")
        tenants[str(name)] = Tenant(
            str(name),
            tuple(keys),
            limits["requestsPerMinute"],
            limits["tokensPerMinute"],
            limits["concurrency"],
            priority,
            float(weight),
            slo["ttftMs"] / 1000 if "ttftMs" in slo else None,
            slo["tpotMs"] / 1000 if "tpotMs" in slo else None,
        )
    return tenants
