"""Whether crds/ still accepts every object the last release's CRDs accepted.

    python3 hack/crd_compat.py check      compare crds/*.yaml with hack/crd-baseline/ (the last release's);
                                          exit 1 naming each breaking change
    python3 hack/crd_compat.py snapshot   make crds/ the new baseline (at a release: `make release`)

Until a v1beta1 with a conversion webhook exists, v1alpha1 changes only additively (docs/install.md,
"CRD upgrades"), so an upgraded CRD never refuses, or silently drops part of, an object stored under
the old one. Breaking, and reported: a served version gone; a field removed; a type changed; an enum
narrowed (a value dropped, or an enum put on a free field); a new required field without a default;
a bound tightened (minimum, maximum, minLength, maxLength, minItems, maxItems).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CRDS = ROOT / "crds"
BASELINE = ROOT / "hack" / "crd-baseline"
LOWER = ("minimum", "minLength", "minItems", "minProperties")  # raising one of these narrows
UPPER = ("maximum", "maxLength", "maxItems", "maxProperties")  # lowering one of these narrows


def _schema_changes(path: str, old: dict[str, Any], new: dict[str, Any] | None) -> list[str]:
    if new is None:
        return [f"{path}: removed"]
    out = []
    if old.get("type") and new.get("type") and old["type"] != new["type"]:
        out.append(f"{path}: type {old['type']} became {new['type']}")
    if "enum" in new:
        if "enum" not in old:
            out.append(f"{path}: an enum ({new['enum']}) on a field that took any value")
        else:
            dropped = [v for v in old["enum"] if v not in new["enum"]]
            if dropped:
                out.append(f"{path}: enum narrowed, {dropped} no longer allowed")
    for key in LOWER:
        if key in new and new[key] > old.get(key, float("-inf")):
            out.append(f"{path}: {key} raised to {new[key]} (was {old.get(key, 'unset')})")
    for key in UPPER:
        if key in new and new[key] < old.get(key, float("inf")):
            out.append(f"{path}: {key} lowered to {new[key]} (was {old.get(key, 'unset')})")
    new_props = new.get("properties") or {}
    added_required = set(new.get("required") or ()) - set(old.get("required") or ())
    for name in sorted(added_required):
        if "default" not in (new_props.get(name) or {}):
            out.append(f"{path}.{name}: newly required, without a default")
    for name, sub in (old.get("properties") or {}).items():
        out += _schema_changes(f"{path}.{name}", sub, new_props.get(name))
    if isinstance(old.get("items"), dict):
        out += _schema_changes(
            f"{path}[]", old["items"], new.get("items") if isinstance(new.get("items"), dict) else None
        )
    if isinstance(old.get("additionalProperties"), dict):
        extra = new.get("additionalProperties")
        out += _schema_changes(f"{path}{{*}}", old["additionalProperties"], extra if isinstance(extra, dict) else None)
    return out


def breaking_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What an object valid under the CRD `old` may meet under `new` (empty: every such object stays valid)."""
    kind = old["spec"]["names"]["kind"]
    out = []
    new_versions = {v["name"]: v for v in new["spec"]["versions"]}
    for version in old["spec"]["versions"]:
        if not version.get("served", True):
            continue
        now = new_versions.get(version["name"])
        if now is None or not now.get("served", True):
            out.append(f"{kind} {version['name']}: no longer served")
            continue
        changes = _schema_changes("", version["schema"]["openAPIV3Schema"], now["schema"]["openAPIV3Schema"])
        out += [f"{kind} {version['name']}: {change.lstrip('.')}" for change in changes]
    return out


def _load(directory: Path) -> dict[str, dict[str, Any]]:
    crds = {}
    for path in sorted(directory.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        if doc and doc.get("kind") == "CustomResourceDefinition":
            crds[doc["metadata"]["name"]] = doc
    return crds


def check(baseline: Path = BASELINE, current: Path = CRDS) -> list[str]:
    old, new = _load(baseline), _load(current)
    out = [f"{name}: CRD removed" for name in old if name not in new]
    for name, crd in old.items():
        if name in new:
            out += breaking_changes(crd, new[name])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/crd_compat.py", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("check", "snapshot"))
    args = parser.parse_args(argv)
    if args.command == "snapshot":
        BASELINE.mkdir(parents=True, exist_ok=True)
        for path in BASELINE.glob("*.yaml"):
            path.unlink()
        for path in CRDS.glob("serving.goodput.dev_*.yaml"):
            shutil.copy(path, BASELINE / path.name)
        print(f"baseline: {', '.join(sorted(p.name for p in BASELINE.glob('*.yaml')))}")
        return 0
    problems = check()
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
