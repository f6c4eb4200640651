"""The floors of the codebase, checked on its source: which package may import which, and no circles.

- The contract (the rules and the API types every component shares) imports the standard library only.
- The gateway reads CRs through ``goodput_contract.api`` and talks to the API server through
  ``goodput_operator.k8s``; it imports nothing else of the operator, and nothing of the runtime.
- The runtime imports neither the operator nor the gateway; the operator imports neither torch nor the
  gateway nor the runtime.
- Inside the runtime the floors run one way: ``layers`` ← ``models`` ← ``engine`` ← ``server``. A layer
  never imports a model or the engine, and a model never imports the engine.
- No import circle among a component's modules, counting imports under ``TYPE_CHECKING`` and inside
  functions (a deferred import that hides a circle is still a circle).

Each rule is also run on a small synthetic tree that breaks it, so a rule that could never fire fails.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {
    "goodput_contract": ROOT / "contract",
    "goodput_operator": ROOT / "operator",
    "goodput_gateway": ROOT / "gateway",
    "goodput_runtime": ROOT / "runtime",
}


@dataclass(frozen=True)
class Rule:
    importer: str  # modules at or under this name
    forbidden: tuple[str, ...]  # may not import these (or anything under them)
    allowed: tuple[str, ...] = ()  # except these
    why: str = ""


RULES = (
    Rule(
        "goodput_gateway",
        ("goodput_operator", "goodput_runtime", "torch"),
        allowed=("goodput_operator.k8s",),
        why="the gateway reads CRs through goodput_contract.api and the API through goodput_operator.k8s only",
    ),
    Rule("goodput_runtime", ("goodput_operator", "goodput_gateway"), why="the runtime stands alone in its pod"),
    Rule(
        "goodput_operator",
        ("torch", "goodput_gateway", "goodput_runtime"),
        why="the operator's image has no torch and reads nothing of the other components",
    ),
    Rule(
        "goodput_runtime.layers",
        ("goodput_runtime.models", "goodput_runtime.engine", "goodput_runtime.server"),
        why="layers are the runtime's lowest floor",
    ),
    Rule(
        "goodput_runtime.models",
        ("goodput_runtime.engine", "goodput_runtime.server"),
        why="models sit on layers, under the engine",
    ),
    Rule("goodput_runtime.engine", ("goodput_runtime.server",), why="the server drives the engine, not the reverse"),
)
CONTRACT = "goodput_contract"  # imports the standard library and itself only


def is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def modules(sources: dict[str, Path]) -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name, for its __init__)."""
    found = {}
    for package, base in sources.items():
        for path in sorted((base / package).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """What `name` imports, anywhere in the file: `from pkg import sub` counts as pkg.sub where sub is a
    module, as pkg (its __init__) where sub is a name defined there."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                found.add(full if full in known else source)
    return found


def graph(sources: dict[str, Path]) -> dict[str, set[str]]:
    known = modules(sources)
    return {name: imports(name, path, known) - {name} for name, path in known.items()}


def violations(edges: dict[str, set[str]]) -> list[str]:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found = []
    for importer, targets in sorted(edges.items()):
        for target in sorted(targets):
            if is_under(importer, CONTRACT):
                top = target.partition(".")[0]
                if top not in stdlib and top != CONTRACT:
                    found.append(f"{importer} imports {target}: the contract imports the standard library only")
            for rule in RULES:
                if not is_under(importer, rule.importer):
                    continue
                if any(is_under(target, f) for f in rule.forbidden) and not any(
                    is_under(target, a) for a in rule.allowed
                ):
                    found.append(f"{importer} imports {target}: {rule.why}")
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start] & edges.keys())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child] & edges.keys()))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups


def write_tree(base: Path, files: dict[str, str]) -> dict[str, Path]:
    for relative, text in files.items():
        path = base / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {package: base for package in SOURCES}


def test_the_components_import_only_across_their_allowed_floors() -> None:
    assert violations(graph(SOURCES)) == []


def test_no_import_circle_remains_in_any_component() -> None:
    assert cycles(graph(SOURCES)) == []


@pytest.mark.parametrize(
    ("relative", "text", "expected"),
    [
        ("goodput_gateway/bad.py", "from goodput_operator.spec import parse\n", "goodput_operator.spec"),
        ("goodput_gateway/bad.py", "from goodput_operator import metrics\n", "goodput_operator.metrics"),
        ("goodput_gateway/bad.py", "import torch\n", "torch"),
        ("goodput_runtime/bad.py", "from goodput_gateway import app\n", "goodput_gateway.app"),
        ("goodput_operator/bad.py", "def f():\n    import torch\n", "torch"),
        ("goodput_contract/bad.py", "import yaml\n", "yaml"),
        ("goodput_runtime/layers/bad.py", "from goodput_runtime.engine import core\n", "goodput_runtime.engine.core"),
        ("goodput_runtime/models/bad.py", "from goodput_runtime.engine.core import X\n", "goodput_runtime.engine.core"),
        (
            "goodput_runtime/layers/bad.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from goodput_runtime.models import llama\n",
            "goodput_runtime.models.llama",
        ),
    ],
)
def test_a_forbidden_import_added_to_a_synthetic_tree_is_caught(
    tmp_path: Path, relative: str, text: str, expected: str
) -> None:
    files = {
        "goodput_gateway/__init__.py": "",
        "goodput_operator/__init__.py": "",
        "goodput_operator/spec.py": "def parse(): ...\n",
        "goodput_operator/metrics.py": "",
        "goodput_operator/k8s.py": "",
        "goodput_runtime/__init__.py": "",
        "goodput_runtime/layers/__init__.py": "",
        "goodput_runtime/models/__init__.py": "",
        "goodput_runtime/models/llama.py": "",
        "goodput_runtime/engine/__init__.py": "",
        "goodput_runtime/engine/core.py": "X = 1\n",
        "goodput_contract/__init__.py": "import re\n",
        "goodput_gateway/app.py": "from goodput_operator.k8s import Kube\nimport json\n",
    }
    sources = write_tree(tmp_path, files)
    assert violations(graph(sources)) == []  # the allowed imports alone pass
    write_tree(tmp_path, {relative: text})
    found = violations(graph(sources))
    assert len(found) == 1 and expected in found[0], found


def test_a_circle_through_type_annotations_or_a_deferred_import_is_caught(tmp_path: Path) -> None:
    sources = write_tree(
        tmp_path,
        {
            "goodput_gateway/__init__.py": "",
            "goodput_gateway/app.py": "from goodput_gateway.pipelines import install\n",
            "goodput_gateway/pipelines/__init__.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from goodput_gateway.app import Gateway\n"
                "def install(): ...\n"
            ),
            "goodput_runtime/__init__.py": "",
            "goodput_runtime/a.py": "def f():\n    from goodput_runtime import b\n",
            "goodput_runtime/b.py": "from goodput_runtime.a import f\n",
            "goodput_runtime/c.py": "from goodput_runtime import a\n",
        },
    )
    assert cycles(graph(sources)) == [
        ["goodput_gateway.app", "goodput_gateway.pipelines"],
        ["goodput_runtime.a", "goodput_runtime.b"],
    ]


GATEWAY_REGISTRY = """
import importlib, pkgutil, sys
import goodput_gateway
for info in pkgutil.walk_packages(goodput_gateway.__path__, "goodput_gateway."):
    importlib.import_module(info.name)
for name in sys.argv[1:]:
    importlib.import_module(name)
from prometheus_client import REGISTRY
print("\\n".join(sorted(m.name for m in REGISTRY.collect())))
"""


def registered_series(*extra_modules: str) -> list[str]:
    """The series a process registers in prometheus_client's default registry once every gateway module
    (and `extra_modules`) is imported."""
    result = subprocess.run(
        [sys.executable, "-c", GATEWAY_REGISTRY, *extra_modules], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()


def test_a_gateway_process_registers_no_operator_series() -> None:
    series = registered_series()
    assert not [s for s in series if s.startswith("goodput_operator")], series
    # the check sees them where they are: the operator's metrics module registers them on import
    assert "goodput_operator_api_writes" in registered_series("goodput_operator.metrics")


# the unit tests of the parts without torch (the contract's own test feeds the runtime's parser, so it needs it)
TORCH_FREE_TESTS = ("test_gateway_*", "test_batch_*", "test_operator_*", "test_pipeline_*", "test_autoscaler_*")
COLLECT = (
    "import sys, pytest\n"
    "rc = pytest.main(['-q', '--collect-only', '-p', 'no:cacheprovider', *sys.argv[1:]])\n"
    "print('torch' in sys.modules)\n"
    "sys.exit(rc)\n"
)


def collecting_imports_torch(*files: Path) -> bool:
    result = subprocess.run(
        [sys.executable, "-c", COLLECT, *map(str, files)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout.split()[-1] == "True"


def test_the_gateway_and_operator_unit_tests_need_no_torch() -> None:
    unit = ROOT / "tests" / "unit"
    files = sorted({path for pattern in TORCH_FREE_TESTS for path in unit.glob(f"{pattern}.py")})
    assert len(files) > 20
    assert not collecting_imports_torch(*files)
    # the check sees torch where a test brings it: the engine's unit tests import it
    assert collecting_imports_torch(unit / "test_engine_client.py")
