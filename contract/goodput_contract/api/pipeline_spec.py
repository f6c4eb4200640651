"""A typed view of an InferencePipeline spec, with the checks the CRD schema cannot make.

Every InferencePipeline field name lives here; the operator (status) and the gateway (serving)
both parse through `parse_pipeline`, so the two agree on what a pipeline means. The steps run
in order: input guards and templates before the one generate step, output guards after it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from goodput_contract.api.spec import SpecError

GUARD, TEMPLATE, GENERATE = "guard", "template", "generate"
INPUT, OUTPUT = "input", "output"
BLOCK, REDACT, ALLOW = "block", "redact", "allow"
PII_TYPES = ("email", "phone", "card")
INPUT_PLACEHOLDER = "{input}"
DEFAULT_HOLD_BACK = 64  # characters of generated text held until no rule can match across them
DEFAULT_REPLACEMENT = "[REDACTED]"
# spec.steps[].defaults: CR field -> the OpenAI request field it fills when the request leaves it out
SAMPLING_DEFAULTS = {
    "temperature": "temperature",
    "topP": "top_p",
    "maxTokens": "max_tokens",
    "presencePenalty": "presence_penalty",
    "frequencyPenalty": "frequency_penalty",
    "seed": "seed",
    "stop": "stop",
}
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class Pattern:
    """One deny-list expression or PII type: `name` is what a refusal and the block metric report."""

    name: str
    pattern: str
    action: str = BLOCK
    replacement: str = DEFAULT_REPLACEMENT


@dataclass(frozen=True)
class Rules:
    max_length: int | None = None  # characters: the prompt's (input) or the generated text's (output)
    deny: tuple[Pattern, ...] = ()
    pii: tuple[Pattern, ...] = ()  # pattern holds the PII type; the gateway owns the expressions

    @property
    def empty(self) -> bool:
        return self.max_length is None and not self.deny and not self.pii


@dataclass(frozen=True)
class Classifier:
    service: str
    template: str
    allow: tuple[str, ...]
    block: tuple[str, ...]
    on_unknown: str = BLOCK
    timeout_seconds: float = 10.0


@dataclass(frozen=True)
class Step:
    name: str
    kind: str
    stage: str = INPUT  # guards only
    rules: Rules = field(default_factory=Rules)
    classifier: Classifier | None = None
    hold_back: int = DEFAULT_HOLD_BACK
    system: str | None = None  # template
    prompt: str | None = None  # template
    service: str = ""  # generate
    defaults: tuple[tuple[str, Any], ...] = ()  # generate: (OpenAI field, value)


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    namespace: str
    steps: tuple[Step, ...]

    @property
    def generate(self) -> Step:
        return next(s for s in self.steps if s.kind == GENERATE)

    @property
    def services(self) -> tuple[str, ...]:
        """Every InferenceService the pipeline calls, in step order, each once."""
        names: list[str] = []
        for step in self.steps:
            for name in (step.classifier.service if step.classifier else "", step.service):
                if name and name not in names:
                    names.append(name)
        return tuple(names)

    @property
    def summary(self) -> str:
        return ",".join(f"{s.kind}:{s.stage}" if s.kind == GUARD else s.kind for s in self.steps)


def _str(value: Any, where: str, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise SpecError(where, "must be a non-empty string")
    return value


def _words(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise SpecError(where, "must be a non-empty list of non-empty words")
    return tuple(v.strip().lower() for v in value)


def _pattern(item: Any, where: str, pii: bool) -> Pattern:
    if not isinstance(item, dict):
        raise SpecError(where, "must be an object")
    action = item.get("action", BLOCK)
    if action not in (BLOCK, REDACT):
        raise SpecError(f"{where}.action", f"must be block or redact, got {action!r}")
    replacement = item.get("replacement", DEFAULT_REPLACEMENT)
    if not isinstance(replacement, str):
        raise SpecError(f"{where}.replacement", "must be a string")
    if pii:
        kind = item.get("type")
        if kind not in PII_TYPES:
            raise SpecError(f"{where}.type", f"must be one of {', '.join(PII_TYPES)}, got {kind!r}")
        return Pattern(f"pii-{kind}", kind, action, replacement)
    name = _str(item.get("name"), f"{where}.name")
    if not _NAME.match(name):
        raise SpecError(f"{where}.name", f"must be a lowercase DNS label (a-z, 0-9, -), got {name!r}")
    expression = _str(item.get("pattern"), f"{where}.pattern")
    try:
        compiled = re.compile(expression)
    except re.error as err:
        raise SpecError(f"{where}.pattern", f"is not a valid regular expression: {err}") from None
    if compiled.match(""):
        raise SpecError(f"{where}.pattern", "matches the empty string, so it would match every text")
    return Pattern(name, expression, action, replacement)


def _rules(value: Any, where: str) -> Rules:
    if value is None:
        return Rules()
    if not isinstance(value, dict):
        raise SpecError(where, "must be an object")
    max_length = value.get("maxLength")
    if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1):
        raise SpecError(f"{where}.maxLength", f"must be a positive integer, got {max_length!r}")
    deny = tuple(_pattern(p, f"{where}.deny[{i}]", pii=False) for i, p in enumerate(value.get("deny") or ()))
    pii = tuple(_pattern(p, f"{where}.pii[{i}]", pii=True) for i, p in enumerate(value.get("pii") or ()))
    names = [p.name for p in (*deny, *pii)]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise SpecError(where, f"names the rule {duplicate!r} twice")
    return Rules(max_length, deny, pii)


def _classifier(value: Any, where: str) -> Classifier:
    if not isinstance(value, dict):
        raise SpecError(where, "must be an object")
    template = _str(value.get("template"), f"{where}.template")
    if INPUT_PLACEHOLDER not in template:
        raise SpecError(f"{where}.template", f"must contain {INPUT_PLACEHOLDER}, where the prompt goes")
    allow, block = _words(value.get("allow"), f"{where}.allow"), _words(value.get("block"), f"{where}.block")
    both = set(allow) & set(block)
    if both:
        raise SpecError(f"{where}.block", f"shares {sorted(both)[0]!r} with allow")
    on_unknown = value.get("onUnknown", BLOCK)
    if on_unknown not in (ALLOW, BLOCK):
        raise SpecError(f"{where}.onUnknown", f"must be allow or block, got {on_unknown!r}")
    timeout = value.get("timeoutSeconds", 10)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise SpecError(f"{where}.timeoutSeconds", f"must be a positive number, got {timeout!r}")
    return Classifier(
        _str(value.get("service"), f"{where}.service"), template, allow, block, on_unknown, float(timeout)
    )


def _defaults(value: Any, where: str) -> tuple[tuple[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise SpecError(where, "must be an object")
    out = []
    for key, item in value.items():
        if key not in SAMPLING_DEFAULTS:
            raise SpecError(f"{where}.{key}", f"is not a sampling field; one of {', '.join(SAMPLING_DEFAULTS)}")
        out.append((SAMPLING_DEFAULTS[key], item))
    return tuple(out)


def _step(value: Any, index: int) -> Step:
    where = f"steps[{index}]"
    if not isinstance(value, dict):
        raise SpecError(where, "must be an object")
    kind = value.get("kind")
    if kind not in (GUARD, TEMPLATE, GENERATE):
        raise SpecError(f"{where}.kind", f"must be guard, template or generate, got {kind!r}")
    name = value.get("name") or f"{kind}-{index}"
    if not isinstance(name, str) or not _NAME.match(name):
        raise SpecError(f"{where}.name", f"must be a lowercase DNS label, got {name!r}")
    allowed = {
        "name",
        "kind",
        *{
            GUARD: ("stage", "rules", "classifier", "holdBack"),
            TEMPLATE: ("system", "prompt"),
            GENERATE: ("service", "defaults"),
        }[kind],
    }
    stray = sorted(set(value) - allowed)
    if stray:
        raise SpecError(f"{where}.{stray[0]}", f"does not apply to a {kind} step")
    if kind == GENERATE:
        return Step(
            name,
            kind,
            service=_str(value.get("service"), f"{where}.service"),
            defaults=_defaults(value.get("defaults"), f"{where}.defaults"),
        )
    if kind == TEMPLATE:
        system = value.get("system")
        prompt = value.get("prompt")
        if system is not None and not isinstance(system, str):
            raise SpecError(f"{where}.system", "must be a string")
        if prompt is not None and (not isinstance(prompt, str) or INPUT_PLACEHOLDER not in prompt):
            raise SpecError(f"{where}.prompt", f"must be a string containing {INPUT_PLACEHOLDER}")
        if system is None and prompt is None:
            raise SpecError(where, "a template step needs a system prompt, a prompt template or both")
        return Step(name, kind, system=system, prompt=prompt)
    stage = value.get("stage", INPUT)
    if stage not in (INPUT, OUTPUT):
        raise SpecError(f"{where}.stage", f"must be input or output, got {stage!r}")
    rules = _rules(value.get("rules"), f"{where}.rules")
    classifier = _classifier(value["classifier"], f"{where}.classifier") if value.get("classifier") else None
    if classifier and stage == OUTPUT:
        raise SpecError(f"{where}.classifier", "runs on input guards only (an output guard filters the stream)")
    if rules.empty and classifier is None:
        raise SpecError(where, "a guard step needs rules, a classifier or both")
    hold_back = value.get("holdBack", DEFAULT_HOLD_BACK)
    if not isinstance(hold_back, int) or isinstance(hold_back, bool) or not 0 <= hold_back <= 4096:
        raise SpecError(f"{where}.holdBack", f"must be an integer from 0 to 4096, got {hold_back!r}")
    if "holdBack" in value and stage == INPUT:
        raise SpecError(f"{where}.holdBack", "applies to output guards only")
    return Step(name, kind, stage, rules, classifier, hold_back)


def parse_pipeline(name: str, namespace: str, spec: dict[str, Any]) -> PipelineSpec:
    steps_value = spec.get("steps")
    if not isinstance(steps_value, list) or not steps_value:
        raise SpecError("steps", "must be a non-empty list")
    steps = tuple(_step(s, i) for i, s in enumerate(steps_value))
    names = [s.name for s in steps]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise SpecError("steps", f"name the step {duplicate!r} twice")
    generates = [i for i, s in enumerate(steps) if s.kind == GENERATE]
    if len(generates) != 1:
        raise SpecError("steps", f"must hold exactly one generate step, got {len(generates)}")
    at = generates[0]
    for i, step in enumerate(steps):
        before = i < at
        if step.kind == TEMPLATE and not before:
            raise SpecError(f"steps[{i}]", "a template step must come before the generate step")
        if step.kind == GUARD and (step.stage == INPUT) != before:
            raise SpecError(f"steps[{i}].stage", "input guards come before the generate step, output guards after")
    return PipelineSpec(name, namespace, steps)
