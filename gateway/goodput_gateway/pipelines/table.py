"""The InferencePipelines the gateway serves, kept current by a watch (or read once from files)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from goodput_contract.api import PIPELINE_KIND
from goodput_contract.api.pipeline_spec import GUARD, PipelineSpec, SpecError, parse_pipeline
from goodput_gateway.pipelines.rules import RuleSet
from goodput_gateway.watch import Table

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    namespace: str
    name: str
    spec: PipelineSpec | None
    error: str = ""  # why the spec is not served
    rules: dict[str, RuleSet] = field(default_factory=dict)  # guard step name -> its compiled rules


def entry_of(body: dict[str, Any]) -> Entry:
    """A pipeline whose spec does not parse is kept, with its error: a request naming it is told why."""
    meta = body["metadata"]
    namespace, name = meta.get("namespace", "default"), meta["name"]
    try:
        spec = parse_pipeline(name, namespace, body.get("spec") or {})
    except SpecError as err:
        logger.info("Not serving pipeline %s/%s: %s", namespace, name, err)
        return Entry(namespace, name, None, str(err))
    return Entry(namespace, name, spec, rules={s.name: RuleSet(s.rules) for s in spec.steps if s.kind == GUARD})


class PipelineTable(Table[Entry]):
    """Pipelines by (namespace, name), and by the name a request's model gives."""

    def __init__(self) -> None:
        super().__init__(entry_of)

    def resolve(self, model: str) -> list[Entry]:
        if "/" in model:
            namespace, _, name = model.partition("/")
            found = self.get((namespace, name))
            return [found] if found else []
        return sorted((e for e in self.values() if e.name == model), key=lambda e: e.namespace)

    def model_id(self, entry: Entry) -> str:
        shared = sum(1 for e in self.values() if e.name == entry.name) > 1
        return f"{entry.namespace}/{entry.name}" if shared else entry.name

    def load_files(self, paths: list[str], namespace: str) -> None:
        """InferencePipeline documents from YAML files, served without a cluster."""
        items = []
        for path in paths:
            for doc in yaml.safe_load_all(Path(path).read_text()):
                if isinstance(doc, dict) and doc.get("kind") == PIPELINE_KIND:
                    doc.setdefault("metadata", {})["namespace"] = namespace
                    items.append(doc)
        self.reset(items)
        for entry in self.values():
            if entry.error:
                raise SystemExit(f"--static-pipeline: {entry.name}: {entry.error}")
