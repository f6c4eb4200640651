"""An InferencePipeline's conditions from its spec and the services it calls (pure)."""

from goodput_contract.api.pipeline_spec import SpecError, parse_pipeline
from goodput_operator.pipelines import pipeline_conditions

SPEC = parse_pipeline(
    "p",
    "ns",
    {
        "steps": [
            {
                "kind": "guard",
                "classifier": {"service": "guard", "template": "{input}", "allow": ["y"], "block": ["n"]},
            },
            {"kind": "generate", "service": "chat"},
        ]
    },
)


def svc(status, reason="Serving"):
    return {"status": {"conditions": [{"type": "Ready", "status": status, "reason": reason, "message": "m"}]}}


def by_type(conds):
    return {c.type: c for c in conds}


def test_ready_when_every_service_is_ready():
    conds, listed = pipeline_conditions(SPEC, {"guard": svc("True"), "chat": svc("True")})
    assert by_type(conds)["Ready"].status == "True"
    assert listed == [{"name": "guard", "ready": True}, {"name": "chat", "ready": True}]


def test_a_missing_service_is_named():
    conds, listed = pipeline_conditions(SPEC, {"guard": svc("True"), "chat": None})
    ready = by_type(conds)["Ready"]
    assert (ready.status, ready.reason) == ("False", "ServiceNotFound")
    assert "'chat'" in ready.message and "guard" not in ready.message
    assert listed[1] == {"name": "chat", "ready": False}


def test_a_service_not_ready_is_named_with_its_reason():
    conds, _ = pipeline_conditions(SPEC, {"guard": svc("False", "Scheduling"), "chat": svc("True")})
    ready = by_type(conds)["Ready"]
    assert (ready.status, ready.reason) == ("False", "ServiceNotReady")
    assert "'guard'" in ready.message and "Scheduling" in ready.message


def test_an_invalid_spec_is_not_valid_and_not_ready():
    conds, _ = pipeline_conditions(SpecError("steps", "must hold exactly one generate step, got 0"), {})
    assert by_type(conds)["Valid"].status == "False"
    assert "spec.steps" in by_type(conds)["Valid"].message
    assert by_type(conds)["Ready"].status == "False"
