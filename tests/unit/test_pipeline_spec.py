"""The InferencePipeline spec as the operator and the gateway read it, and the CRD users apply it through."""

from pathlib import Path

import pytest
import yaml

from goodput_contract.api.pipeline_spec import GENERATE, GUARD, OUTPUT, SpecError, parse_pipeline

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "serving.goodput.dev_inferencepipelines.yaml"


def steps(*items):
    return {"steps": list(items)}


GENERATE_STEP = {"kind": "generate", "service": "chat", "defaults": {"temperature": 0.2, "maxTokens": 64}}


def test_the_sample_pipeline_parses_and_names_its_services_in_step_order():
    sample = yaml.safe_load((ROOT / "manifests" / "samples" / "pipeline.yaml").read_text())
    spec = parse_pipeline(sample["metadata"]["name"], "default", sample["spec"])
    assert [s.kind for s in spec.steps] == [GUARD, GUARD, "template", GENERATE, GUARD]
    assert spec.steps[-1].stage == OUTPUT
    assert spec.services == ("guard", "chat")
    assert spec.summary == "guard:input,guard:input,template,generate,guard:output"


def test_generate_defaults_become_openai_fields():
    spec = parse_pipeline("p", "ns", steps(GENERATE_STEP))
    assert dict(spec.generate.defaults) == {"temperature": 0.2, "max_tokens": 64}


@pytest.mark.parametrize(
    ("spec", "field", "why"),
    [
        (steps(), "spec.steps", "non-empty"),
        (steps({"kind": "template", "system": "x"}), "spec.steps", "exactly one generate"),
        (steps(GENERATE_STEP, GENERATE_STEP), "spec.steps", "exactly one generate"),
        (steps(GENERATE_STEP, {"kind": "template", "system": "x"}), "spec.steps[1]", "before the generate"),
        (
            steps({"kind": "guard", "stage": "output", "rules": {"maxLength": 5}}, GENERATE_STEP),
            "spec.steps[0].stage",
            "output guards after",
        ),
        (
            steps({"kind": "guard", "rules": {"deny": [{"name": "x", "pattern": "("}]}}, GENERATE_STEP),
            "spec.steps[0].rules.deny[0].pattern",
            "not a valid regular expression",
        ),
        (
            steps({"kind": "guard", "rules": {"deny": [{"name": "x", "pattern": "a*"}]}}, GENERATE_STEP),
            "spec.steps[0].rules.deny[0].pattern",
            "empty string",
        ),
        (
            steps({"kind": "guard", "rules": {"pii": [{"type": "ssn"}]}}, GENERATE_STEP),
            "spec.steps[0].rules.pii[0].type",
            "email, phone, card",
        ),
        (steps({"kind": "guard"}, GENERATE_STEP), "spec.steps[0]", "rules, a classifier or both"),
        (
            steps(
                {
                    "kind": "guard",
                    "classifier": {"service": "g", "template": "no placeholder", "allow": ["yes"], "block": ["no"]},
                },
                GENERATE_STEP,
            ),
            "spec.steps[0].classifier.template",
            "{input}",
        ),
        (
            steps(
                {
                    "kind": "guard",
                    "classifier": {"service": "g", "template": "{input}", "allow": ["yes"], "block": ["Yes"]},
                },
                GENERATE_STEP,
            ),
            "spec.steps[0].classifier.block",
            "shares 'yes'",
        ),
        (
            steps(
                GENERATE_STEP,
                {
                    "kind": "guard",
                    "stage": "output",
                    "classifier": {"service": "g", "template": "{input}", "allow": ["a"], "block": ["b"]},
                },
            ),
            "spec.steps[1].classifier",
            "input guards only",
        ),
        (steps({"kind": "template", "prompt": "no placeholder"}, GENERATE_STEP), "spec.steps[0].prompt", "{input}"),
        (steps({**GENERATE_STEP, "system": "x"}), "spec.steps[0].system", "does not apply to a generate step"),
        (steps({**GENERATE_STEP, "defaults": {"logprobs": True}}), "spec.steps[0].defaults.logprobs", "not a sampling"),
        (
            steps({"kind": "guard", "holdBack": 8, "rules": {"maxLength": 9}}, GENERATE_STEP),
            "spec.steps[0].holdBack",
            "output guards only",
        ),
    ],
)
def test_a_rejected_spec_names_the_field_and_why(spec, field, why):
    with pytest.raises(SpecError) as err:
        parse_pipeline("p", "ns", spec)
    assert err.value.field == field
    assert why in str(err.value)


def _undescribed(schema, path):
    missing = [] if "description" in schema or path.endswith(".metadata") else [path]
    for name, child in (schema.get("properties") or {}).items():
        missing += _undescribed(child, f"{path}.{name}")
    if "items" in schema and schema["items"].get("properties"):
        for name, child in schema["items"]["properties"].items():
            missing += _undescribed(child, f"{path}[].{name}")
    return missing


def test_the_crd_explains_every_field_and_has_its_names_and_columns():
    crd = yaml.safe_load(CRD.read_text())
    assert crd["metadata"]["name"] == "inferencepipelines.serving.goodput.dev"
    assert crd["spec"]["names"]["kind"] == "InferencePipeline"
    assert crd["spec"]["names"]["shortNames"] == ["gpipe"]
    (version,) = crd["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Steps", "Ready", "Status", "Age", "Message"]
    assert _undescribed(version["schema"]["openAPIV3Schema"], "inferencepipeline") == []
    kustomization = yaml.safe_load((ROOT / "crds" / "kustomization.yaml").read_text())
    assert CRD.name in kustomization["resources"]


def test_every_step_field_in_the_crd_is_one_the_parser_reads():
    """No field the schema accepts is ignored: each is parsed for some kind of step."""
    crd = yaml.safe_load(CRD.read_text())
    step = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["steps"]
    fields = set(step["items"]["properties"])
    assert fields == {
        "name",
        "kind",
        "stage",
        "holdBack",
        "rules",
        "classifier",
        "system",
        "prompt",
        "service",
        "defaults",
    }
    defaults = set(step["items"]["properties"]["defaults"]["properties"])
    generate = {"kind": "generate", "service": "s", "defaults": dict.fromkeys(defaults, 1)}
    spec = parse_pipeline("p", "ns", steps(generate))
    assert len(spec.generate.defaults) == len(defaults)
