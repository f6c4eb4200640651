"""The CRD file: every field explained for kubectl explain, and the API's names (group, kind, short name,
version, subresources, printer columns) as users and the operator rely on them."""

from pathlib import Path

import yaml

CRD = Path(__file__).resolve().parents[2] / "crds" / "serving.goodput.dev_inferenceservices.yaml"


def _load():
    return yaml.safe_load(CRD.read_text())


def _undescribed(schema, path):
    missing = [] if "description" in schema or path.endswith(".metadata") else [path]
    for name, child in (schema.get("properties") or {}).items():
        missing += _undescribed(child, f"{path}.{name}")
    if "items" in schema and schema["items"].get("properties"):
        for name, child in schema["items"]["properties"].items():
            missing += _undescribed(child, f"{path}[].{name}")
    return missing


def test_every_field_has_a_description_for_kubectl_explain():
    (version,) = _load()["spec"]["versions"]
    assert _undescribed(version["schema"]["openAPIV3Schema"], "inferenceservice") == []


def test_names_subresources_and_columns():
    crd = _load()
    assert crd["metadata"]["name"] == "inferenceservices.serving.goodput.dev"
    assert crd["spec"]["names"]["shortNames"] == ["gsvc"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1"
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Model",
        "Replicas",
        "Ready",
        "Status",
        "Attainment",
        "Age",
        "Message",
    ]
