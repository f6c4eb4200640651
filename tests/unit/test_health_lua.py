"""The Argo CD health checks (gitops/argocd/resource_customizations/serving.goodput.dev/*/health.lua) run in a
real Lua interpreter (lupa: Lua 5.1, the language of Argo CD's gopher-lua, and Lua 5.4) against fixtures whose
status the operator's own code built (hack/health_testdata.py), in the layout of Argo CD's own tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
HEALTH = ROOT / "gitops" / "argocd" / "resource_customizations" / "serving.goodput.dev"
KINDS = ("InferenceService", "InferencePipeline", "LoraAdapter", "ModelCache")
LUAS = ("lua51", "lua54")


def _testdata_script() -> Any:
    spec = importlib.util.spec_from_file_location("health_testdata", ROOT / "hack" / "health_testdata.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["health_testdata"] = module
    spec.loader.exec_module(module)
    return module


def _to_lua(lua: Any, value: Any) -> Any:
    """JSON-like Python data as Lua tables, lists 1-indexed, as Argo CD hands `obj` to the script."""
    if isinstance(value, dict):
        return lua.table_from({k: _to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([_to_lua(lua, v) for v in value])
    return value


def health(kind: str, obj: dict[str, Any], flavour: str = "lua51") -> dict[str, Any]:
    module = importlib.import_module(f"lupa.{flavour}")
    lua = module.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = _to_lua(lua, obj)
    script = (HEALTH / kind / "health.lua").read_text()
    result = lua.execute(script)
    return dict(result)


def cases() -> list[tuple[str, str, str, str]]:
    out = []
    for kind in KINDS:
        tests = yaml.safe_load((HEALTH / kind / "health_test.yaml").read_text())["tests"]
        for test in tests:
            out.extend((kind, test["inputPath"], test["healthStatus"]["status"], flavour) for flavour in LUAS)
    return out


def test_fixtures_are_what_the_operator_writes_now():
    stale = [p for p, text in _testdata_script().files().items() if not p.exists() or p.read_text() != text]
    assert stale == [], f"{stale}: run `python3 hack/health_testdata.py`"


def test_every_state_has_a_fixture():
    for kind, wanted in (
        ("InferenceService", {"Progressing", "Degraded", "Suspended", "Healthy"}),
        ("InferencePipeline", {"Progressing", "Degraded", "Healthy"}),
        ("LoraAdapter", {"Progressing", "Degraded", "Healthy"}),
        ("ModelCache", {"Progressing", "Degraded", "Healthy"}),
    ):
        tests = yaml.safe_load((HEALTH / kind / "health_test.yaml").read_text())["tests"]
        assert {t["healthStatus"]["status"] for t in tests} == wanted


@pytest.mark.parametrize(("kind", "path", "status", "flavour"), cases())
def test_health_of_each_fixture(kind, path, status, flavour):
    obj = yaml.safe_load((HEALTH / kind / path).read_text())
    hs = health(kind, obj, flavour)
    assert hs["status"] == status, hs
    assert hs["message"]


def _fixture(kind: str, name: str) -> dict[str, Any]:
    return yaml.safe_load((HEALTH / kind / "testdata" / f"{name}.yaml").read_text())


def test_messages_say_why():
    crash = health("InferenceService", _fixture("InferenceService", "crash_loop"))
    assert crash["message"].startswith("RuntimeFailing: pod chat-7d9f-a: runtime exited 1")
    invalid = health("InferenceService", _fixture("InferenceService", "invalid"))
    assert "spec.model.source" in invalid["message"]
    rolling = health("InferenceService", _fixture("InferenceService", "rolling"))
    assert rolling["message"] == "Serving; 2/3 replicas ready"
    lagging = health("InferencePipeline", _fixture("InferencePipeline", "generation_lags"))
    assert lagging["message"] == "Waiting for the operator to observe generation 2"


def test_a_refused_spec_that_was_since_fixed_is_progressing_not_degraded():
    obj = _fixture("InferenceService", "invalid")
    obj["metadata"]["generation"] = 2  # the user fixed the spec; the operator has not seen it yet
    assert health("InferenceService", obj)["status"] == "Progressing"
