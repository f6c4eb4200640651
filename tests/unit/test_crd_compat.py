"""crds/ stays compatible with the last release's CRDs (hack/crd-baseline/): v1alpha1 changes only additively
until a v1beta1 with conversion exists (docs/install.md). The checker reports each kind of breaking change
and lets additive ones through."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _compat() -> Any:
    spec = importlib.util.spec_from_file_location("crd_compat", ROOT / "hack" / "crd_compat.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["crd_compat"] = module
    spec.loader.exec_module(module)
    return module


compat = _compat()
SERVICE = yaml.safe_load((ROOT / "crds" / "serving.goodput.dev_inferenceservices.yaml").read_text())


def test_crds_accept_every_object_the_last_release_accepted():
    assert compat.check() == [], "a breaking CRD change: make it additive (docs/install.md, CRD upgrades)"


def test_the_baseline_holds_every_crd():
    names = {p.name for p in (ROOT / "crds").glob("serving.goodput.dev_*.yaml")}
    assert names <= {p.name for p in compat.BASELINE.glob("*.yaml")}


def _spec(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _changed(edit) -> list[str]:
    new = copy.deepcopy(SERVICE)
    edit(new)
    return compat.breaking_changes(SERVICE, new)


def _model(crd):
    return _spec(crd)["properties"]["model"]


def _engine_kind(crd):
    return _spec(crd)["properties"]["engine"]["properties"]["kind"]


@pytest.mark.parametrize(
    ("edit", "reported"),
    [
        (lambda c: _model(c)["properties"].pop("servedName"), "spec.model.servedName: removed"),
        (lambda c: _engine_kind(c).update(enum=["goodput", "vllm"]), "spec.engine.kind: enum narrowed, ['sglang']"),
        (
            lambda c: (
                _model(c)["properties"].update(tenant={"type": "string"}),
                _model(c).setdefault("required", []).append("tenant"),
            ),
            "spec.model.tenant: newly required, without a default",
        ),
        (lambda c: _model(c)["properties"]["servedName"].update(type="integer"), "type string became integer"),
        (lambda c: _model(c)["properties"]["servedName"].update(maxLength=3), "spec.model.servedName: maxLength"),
        (lambda c: c["spec"]["versions"][0].update(served=False), "v1alpha1: no longer served"),
    ],
    ids=["removed", "enum-narrowed", "required-without-default", "type", "bound", "version"],
)
def test_a_breaking_change_is_reported(edit, reported):
    changes = _changed(edit)
    assert any(reported in line for line in changes), changes


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: _model(c)["properties"].update(adapter={"type": "string"}),  # a new optional field
        lambda c: _engine_kind(c)["enum"].append("trtllm"),  # an enum widened
        lambda c: (  # a new required field with a default: old objects get it
            _model(c)["properties"].update(tier={"type": "string", "default": "standard"}),
            _model(c).setdefault("required", []).append("tier"),
        ),
    ],
    ids=["optional-field", "enum-widened", "required-with-default"],
)
def test_an_additive_change_passes(edit):
    assert _changed(edit) == []
