"""Writes the Argo CD health checks' fixtures (gitops/argocd/.../testdata/*.yaml) from the operator's own code.

    python3 hack/health_testdata.py           write them
    python3 hack/health_testdata.py --check   exit 1 naming each fixture that differs

Each fixture is an InferenceService, InferencePipeline, LoraAdapter or ModelCache whose status is built by the
functions the operator writes status with (goodput_operator.reconcile, .pods, .conditions, .pipelines,
.lora_adapters, .model_cache_agent) from the pods and Deployment of one situation, so the health
checks are tested against what the operator (and the caching agent) really writes. Each
health_test.yaml beside them names the health each fixture must get, in the layout of Argo CD's
resource_customizations tests.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from goodput_contract.api.pipeline_spec import parse_pipeline
from goodput_contract.api.spec import SpecError, parse
from goodput_operator import lora_adapters, pods
from goodput_operator.conditions import (
    FALSE,
    MODEL_FITS,
    READY,
    TRUE,
    UNKNOWN,
    VALID,
    Condition,
    derive_kstatus,
    derive_ready,
    merge,
)
from goodput_operator.lora_adapters import Outcome, status_body
from goodput_operator.model_cache_agent import Progress, summary
from goodput_operator.pipelines import pipeline_conditions
from goodput_operator.reconcile import _available

ROOT = Path(__file__).resolve().parent.parent
HEALTH = ROOT / "gitops" / "argocd" / "resource_customizations" / "serving.goodput.dev"
NOW = "2026-01-01T00:00:00Z"
FITS = Condition(MODEL_FITS, UNKNOWN, "ConfigNotFetched", "config.json is only fetched for hf:// sources")
SPEC: dict[str, Any] = {
    "model": {"source": "pvc://models/smollm2", "servedName": "chat"},
    "resources": {"cpu": "2", "memory": "4Gi"},
    "replicas": 2,
}


def service(spec: dict[str, Any], status: dict[str, Any] | None, generation: int = 1) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "serving.goodput.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "models", "generation": generation},
        "spec": spec,
    }
    if status is not None:
        obj["status"] = status
    return obj


def served(spec: dict[str, Any], deployment: dict[str, Any], runtime_pods: list[dict[str, Any]]) -> dict[str, Any]:
    """The status a reconcile writes for a valid spec (reconcile._reconcile)."""
    svc = parse("chat", "models", spec)
    failure = pods.failure(runtime_pods)
    available = _available(deployment, svc.desired_replicas, failure)
    conditions = [Condition(VALID, TRUE, "SpecValid", "the spec is valid"), FITS, available]
    conditions.append(derive_ready(conditions))
    dstatus = deployment.get("status") or {}
    desired = 0 if svc.suspend else svc.desired_replicas
    conditions += derive_kstatus(conditions, dstatus.get("replicas", 0), dstatus.get("readyReplicas", 0), desired)
    return {
        "observedGeneration": 1,
        "replicas": dstatus.get("replicas", 0),
        "readyReplicas": dstatus.get("readyReplicas", 0),
        "conditions": merge(None, conditions, 1, NOW),
    }


def refused(spec: dict[str, Any]) -> dict[str, Any]:
    """The status a reconcile writes for a spec it refuses (reconcile._refuse)."""
    try:
        parse("chat", "models", spec)
    except SpecError as err:
        conditions = [Condition(VALID, FALSE, err.reason, str(err))]
        conditions.append(derive_ready(conditions))
        conditions += derive_kstatus(conditions, 0, 0, 0)
        return {"observedGeneration": 1, "conditions": merge(None, conditions, 1, NOW)}
    raise AssertionError(f"the spec {spec} is valid")


def pod(name: str, container: dict[str, Any], scheduled: dict[str, Any] | None = None) -> dict[str, Any]:
    conditions = [scheduled or {"type": "PodScheduled", "status": "True"}]
    return {"metadata": {"name": name}, "status": {"phase": "Running", "conditions": conditions, **container}}


def crashing(name: str) -> dict[str, Any]:
    return pod(
        name,
        {
            "containerStatuses": [
                {
                    "name": "runtime",
                    "ready": False,
                    "restartCount": 4,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1, "message": "ValueError: unknown architecture Foo"}},
                }
            ]
        },
    )


def image_pull(name: str) -> dict[str, Any]:
    return pod(
        name,
        {
            "containerStatuses": [
                {
                    "name": "runtime",
                    "image": "registry.example/goodput-runtime:0.0.0",
                    "ready": False,
                    "state": {"waiting": {"reason": "ImagePullBackOff", "message": "manifest unknown"}},
                }
            ]
        },
    )


def starting(name: str) -> dict[str, Any]:
    return pod(name, {"containerStatuses": [{"name": "runtime", "ready": False, "state": {"running": {}}}]})


def deployment(replicas: int, ready: int, **extra: Any) -> dict[str, Any]:
    return {"status": {"replicas": replicas, "readyReplicas": ready, **extra}}


def service_fixtures() -> dict[str, tuple[dict[str, Any], str]]:
    """fixture name -> (object, the health Argo CD must show)."""
    bad = {**SPEC, "model": {"source": "ftp://nowhere/model"}}
    zero = {**SPEC, "replicas": 0}
    deadline = {
        "conditions": [
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "too slow"}
        ]
    }
    unschedulable = pod(
        "chat-7d9f-a",
        {"containerStatuses": []},
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/1 nodes: Insufficient cpu",
        },
    )
    return {
        "no_status": (service(SPEC, None), "Progressing"),
        "generation_lags": (service(SPEC, served(SPEC, deployment(2, 2), []), generation=2), "Progressing"),
        "starting": (service(SPEC, served(SPEC, deployment(2, 0), [starting("chat-7d9f-a")])), "Progressing"),
        "unschedulable": (service(SPEC, served(SPEC, deployment(2, 0), [unschedulable])), "Progressing"),
        "rolling": (service(SPEC, served(SPEC, deployment(3, 2), [starting("chat-8e1a-c")])), "Progressing"),
        "crash_loop": (service(SPEC, served(SPEC, deployment(2, 0), [crashing("chat-7d9f-a")])), "Degraded"),
        "image_pull": (service(SPEC, served(SPEC, deployment(2, 0), [image_pull("chat-7d9f-a")])), "Degraded"),
        "deadline": (service(SPEC, served(SPEC, deployment(2, 0, **deadline), [])), "Degraded"),
        "invalid": (service(bad, refused(bad)), "Degraded"),
        "scaled_to_zero": (service(zero, served(zero, deployment(0, 0), [])), "Suspended"),
        "ready": (service(SPEC, served(SPEC, deployment(2, 2), [])), "Healthy"),
    }


PIPELINE_SPEC: dict[str, Any] = {
    "steps": [
        {
            "name": "on-topic",
            "kind": "guard",
            "classifier": {"service": "guard", "template": "On topic? {input}", "allow": ["yes"], "block": ["no"]},
        },
        {"name": "answer", "kind": "generate", "service": "chat"},
    ]
}


def pipeline(spec: dict[str, Any], services: dict[str, dict[str, Any] | None], generation: int = 1) -> dict[str, Any]:
    """An InferencePipeline with the status reconcile_pipeline writes (pipelines.pipeline_conditions)."""
    try:
        parsed: Any = parse_pipeline("safe-chat", "models", spec)
    except SpecError as err:
        parsed = err
    current, listed = pipeline_conditions(parsed, services)
    status = {"observedGeneration": 1, "conditions": merge(None, current, 1, NOW), "services": listed}
    return {
        "apiVersion": "serving.goodput.dev/v1alpha1",
        "kind": "InferencePipeline",
        "metadata": {"name": "safe-chat", "namespace": "models", "generation": generation},
        "spec": spec,
        "status": status,
    }


def pipeline_fixtures() -> dict[str, tuple[dict[str, Any], str]]:
    ready = service_fixtures()["ready"][0]
    starting_svc = service_fixtures()["starting"][0]
    bad = {"steps": [{"name": "answer", "kind": "teleport"}]}
    no_status = pipeline(PIPELINE_SPEC, {})
    del no_status["status"]
    return {
        "no_status": (no_status, "Progressing"),
        "generation_lags": (pipeline(PIPELINE_SPEC, {"guard": ready, "chat": ready}, generation=2), "Progressing"),
        "service_not_ready": (pipeline(PIPELINE_SPEC, {"guard": ready, "chat": starting_svc}), "Progressing"),
        "service_not_found": (pipeline(PIPELINE_SPEC, {"guard": ready, "chat": None}), "Degraded"),
        "invalid": (pipeline(bad, {}), "Degraded"),
        "ready": (pipeline(PIPELINE_SPEC, {"guard": ready, "chat": ready}), "Healthy"),
    }


LORA_SPEC = {"service": "chat", "source": "file:///adapters/sql", "replicas": "all", "pinned": False}


def lora_adapter(outcome: Outcome | None, generation: int = 1) -> dict[str, Any]:
    """A LoraAdapter with the status its pass writes (lora_adapters.status_body), or none yet."""
    obj: dict[str, Any] = {
        "apiVersion": "serving.goodput.dev/v1alpha1",
        "kind": "LoraAdapter",
        "metadata": {"name": "sql", "namespace": "models", "generation": generation},
        "spec": LORA_SPEC,
    }
    if outcome is not None:
        status = status_body({"metadata": {"generation": 1}}, outcome)
        obj["status"] = {k: v for k, v in status.items() if v is not None}
        for c in obj["status"]["conditions"]:
            c["lastTransitionTime"] = NOW
    return obj


def lora_adapter_fixtures() -> dict[str, tuple[dict[str, Any], str]]:
    valid = Condition(VALID, TRUE, "Valid", "/adapters/sql on InferenceService 'chat'")
    loaded = Outcome(
        "Ready",
        ["chat-7d9c-a", "chat-7d9c-b"],
        2,
        "",
        valid,
        Condition(READY, TRUE, "Loaded", "held by 2 of 2 ready replicas"),
        1,
    )
    refusal = "chat-7d9c-a: adapter 'sql': rank 32 is above --max-lora-rank 16"
    return {
        "no_status": (lora_adapter(None), "Progressing"),
        "generation_lags": (lora_adapter(loaded, generation=2), "Progressing"),
        "pending": (
            lora_adapter(
                Outcome(
                    "Pending",
                    [],
                    0,
                    "",
                    valid,
                    Condition(READY, FALSE, "NoReadyReplicas", "InferenceService 'chat' has no ready replica"),
                )
            ),
            "Progressing",
        ),
        "loading": (
            lora_adapter(
                Outcome(
                    "Loading",
                    ["chat-7d9c-a"],
                    2,
                    "",
                    valid,
                    Condition(READY, FALSE, "Loading", "held by 1 of the 2 replicas that should"),
                )
            ),
            "Progressing",
        ),
        "service_not_found": (
            lora_adapter(
                lora_adapters.refused(
                    SpecError("service", "InferenceService 'chat' not found", reason="ServiceNotFound")
                )
            ),
            "Degraded",
        ),
        "load_refused": (
            lora_adapter(Outcome("Failed", [], 2, refusal, valid, Condition(READY, FALSE, "LoadRefused", refusal))),
            "Degraded",
        ),
        "ready": (lora_adapter(loaded), "Healthy"),
    }


def model_cache(nodes: dict[str, Progress] | None, generation: int = 1) -> dict[str, Any]:
    """A ModelCache with the status its nodes' agents write (model_cache_agent.Status), or none yet."""
    obj: dict[str, Any] = {
        "apiVersion": "serving.goodput.dev/v1alpha1",
        "kind": "ModelCache",
        "metadata": {"name": "llama-70b", "namespace": "models", "generation": generation},
        "spec": {"source": "hf://meta-llama/Llama-3.1-70B-Instruct", "revision": "main"},
    }
    if nodes is not None:
        path = Path("/var/lib/goodput/models/models/llama-70b")
        entries = {name: p.entry(path, 1) for name, p in nodes.items()}
        for entry in entries.values():
            entry["updatedAt"] = NOW
        obj["status"] = {**summary(entries), "nodes": entries, "observedGeneration": 1}
    return obj


def model_cache_fixtures() -> dict[str, tuple[dict[str, Any], str]]:
    total = 141_107_412_992
    ready = Progress(files=37, files_done=37, bytes_total=total, bytes_done=total, downloaded=total, phase="Ready")
    moving = Progress(files=37, files_done=12, bytes_total=total, bytes_done=total // 3, downloaded=total // 3)
    moving.phase, moving.rate = "Downloading", 850_000_000.0
    failed = Progress(files=37, files_done=30, bytes_total=total, bytes_done=total - 4_983_112_192, phase="Failed")
    failed.failed_file, failed.attempts = "model-00031-of-00037.safetensors", 5
    failed.last_error = "model-00031-of-00037.safetensors: HTTP 503 Service Unavailable (after 5 tries)"
    return {
        "no_status": (model_cache(None), "Progressing"),
        "generation_lags": (model_cache({"gpu-node-1": ready}, generation=2), "Progressing"),
        "downloading": (model_cache({"gpu-node-1": ready, "gpu-node-2": moving}), "Progressing"),
        "file_failed": (model_cache({"gpu-node-1": ready, "gpu-node-2": failed}), "Degraded"),
        "ready": (model_cache({"gpu-node-1": ready, "gpu-node-2": ready}), "Healthy"),
    }


def files() -> dict[Path, str]:
    out: dict[Path, str] = {}
    for kind, fixtures in (
        ("InferenceService", service_fixtures()),
        ("InferencePipeline", pipeline_fixtures()),
        ("LoraAdapter", lora_adapter_fixtures()),
        ("ModelCache", model_cache_fixtures()),
    ):
        tests = []
        for name, (obj, health) in fixtures.items():
            out[HEALTH / kind / "testdata" / f"{name}.yaml"] = yaml.safe_dump(obj, sort_keys=False)
            tests.append({"healthStatus": {"status": health}, "inputPath": f"testdata/{name}.yaml"})
        out[HEALTH / kind / "health_test.yaml"] = (
            "# Generated by hack/health_testdata.py from the operator's own status code.\n"
            + yaml.safe_dump({"tests": tests}, sort_keys=False)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    stale = [p for p, text in files().items() if not p.exists() or p.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run `python3 hack/health_testdata.py`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files().items():
        if path in stale:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
