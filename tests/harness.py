"""Helpers for the operator tests: polling, API shortcuts, scratch namespaces, a Hub stand-in, the operator process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import helpers
import kubernetes
from kubernetes.client.exceptions import ApiException

from goodput_contract.api import GROUP, PLURAL, VERSION

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "serving.goodput.dev_inferenceservices.yaml"

RUNTIME_IMAGE = "registry.test/goodput-runtime:test"
WAIT_SECONDS = 60.0


def wait_for(check: Callable[[], Any], timeout: float = WAIT_SECONDS, what: str = "condition") -> Any:
    """helpers.wait_for as this tier polls: every 0.25 s, API and connection errors counting as "not yet"."""
    return helpers.wait_for(check, timeout, what, every=0.25, ignore=(ApiException, OSError))


def service_account_kubeconfig(cluster: Any, manifests: tuple[str, ...], account: str, out: Path) -> Path:
    """Applies `manifests` (from manifests/) and writes a kubeconfig at `out` that acts as the
    ServiceAccount goodput-system/`account`, through a token the API server issues for it."""
    import yaml

    for part in manifests:
        cluster.kubectl("apply", "-f", str(ROOT / "manifests" / part))
    token = wait_for(
        lambda: (
            cluster.core.create_namespaced_service_account_token(
                account,
                "goodput-system",
                {"spec": {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": 3600}},
            ).status.token
        ),
        30,
        "a ServiceAccount token",
    )
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["users"] = [{"name": account, "user": {"token": token}}]
    config["contexts"][0]["context"]["user"] = account
    out.write_text(yaml.safe_dump(config))
    return out


@dataclass
class Cluster:
    dir: Path
    kubeconfig: Path
    bin: Path
    api: kubernetes.client.ApiClient = field(repr=False)

    @property
    def kubectl_path(self) -> str:
        return str(self.bin / "kubectl") if (self.bin / "kubectl").exists() else "kubectl"

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        check: bool = True,
        input_text: str | None = None,
        kubectl: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        cmd = [
            kubectl or self.kubectl_path,
            "--kubeconfig",
            str(kubeconfig or self.kubeconfig),
            "--cache-dir",
            str(self.dir / "kubectl-cache"),
            *args,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, input=input_text, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.api)

    @property
    def apps(self) -> kubernetes.client.AppsV1Api:
        return kubernetes.client.AppsV1Api(self.api)

    @property
    def custom(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.api)

    @contextlib.contextmanager
    def scratch_namespace(self, prefix: str = "t") -> Iterator[str]:
        """A namespace of a fresh name (`prefix`-…), deleted afterwards."""
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.core.create_namespace({"metadata": {"name": name}})
        try:
            yield name
        finally:
            try:
                self.core.delete_namespace(name)
            except ApiException:
                pass

    def raw(self, method: str, path: str, body: Any = None) -> Any:
        """A plain API call, for resources whose version depends on the server (policy, autoscaling)."""
        request = self.api.param_serialize(
            method,
            path,
            header_params={"Accept": "application/json", "Content-Type": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*request, _request_timeout=30)
        data = response.read()
        if not 200 <= response.status <= 299:
            raise ApiException(status=response.status, reason=response.reason)
        return json.loads(data) if data else None

    def path(self, group: str, namespace: str, plural: str, name: str) -> str:
        """The object's path at its group's preferred version on this server."""
        groups = self.raw("GET", "/apis")["groups"]
        version = next(g["preferredVersion"]["groupVersion"] for g in groups if g["name"] == group)
        return f"/apis/{version}/namespaces/{namespace}/{plural}/{name}"

    @property
    def has_controllers(self) -> bool:
        """Whether kube-controller-manager runs (garbage collection, the Deployment controller)."""
        return (self.dir / "pids").exists() and "kube-controller-manager" in (self.dir / "pids").read_text()

    # InferenceServices

    def create_service(self, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": spec,
        }
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)

    def get_service(self, namespace: str, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)

    def patch_service(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, patch)

    def condition(self, namespace: str, name: str, type_: str) -> dict[str, Any] | None:
        status = self.get_service(namespace, name).get("status") or {}
        return next((c for c in status.get("conditions") or () if c["type"] == type_), None)

    def wait_condition(
        self, namespace: str, name: str, type_: str, status: str, timeout: float = WAIT_SECONDS
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            c = self.condition(namespace, name, type_)
            return c if c and c["status"] == status else None

        return wait_for(check, timeout, f"{name} {type_}={status}")

    def get_or_none(self, read: Callable[..., Any], *args: Any) -> Any:
        try:
            return read(*args)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def deployment(self, namespace: str, name: str) -> Any:
        return self.get_or_none(self.apps.read_namespaced_deployment, f"{name}-runtime", namespace)

    def wait_deployment(self, namespace: str, name: str, timeout: float = WAIT_SECONDS) -> Any:
        return wait_for(lambda: self.deployment(namespace, name), timeout, f"Deployment {name}-runtime")

    def wait_kube_service(self, namespace: str, name: str, timeout: float = WAIT_SECONDS) -> Any:
        """The Kubernetes Service the operator makes beside the Deployment (it may land a moment later)."""
        return wait_for(lambda: self.core.read_namespaced_service(name, namespace), timeout, f"Service {name}")

    def wait_settled(self, namespace: str, name: str, timeout: float = WAIT_SECONDS) -> None:
        """Until the Deployment controller has caught up and the service's status shows it."""
        if not self.has_controllers:
            return

        def settled() -> bool:
            d = self.deployment(namespace, name)
            status = self.get_service(namespace, name).get("status") or {}
            return bool(
                d
                and d.status
                and d.status.observed_generation == d.metadata.generation
                and d.status.conditions
                and (d.status.replicas or 0) == d.spec.replicas
                and status.get("replicas") == d.spec.replicas
            )

        wait_for(settled, timeout, f"{name} to settle")

    def events(self, namespace: str, name: str) -> list[Any]:
        events = self.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
        return list(events.items)


class HubHandler(BaseHTTPRequestHandler):
    """A Hugging Face Hub stand-in over real HTTP: /<repo>/resolve/<rev>/config.json."""

    configs: dict[str, dict[str, Any]] = {}
    gated: dict[str, str] = {}  # repo -> token it needs
    requests: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:
        match = re.match(r"^/(?P<repo>.+)/resolve/(?P<rev>[^/]+)/config\.json$", self.path)
        auth = self.headers.get("Authorization")
        self.requests.append((self.path, auth))
        repo = match["repo"] if match else ""
        if repo in self.gated and auth != f"Bearer {self.gated[repo]}":
            self._reply(401, {"error": "gated"})
        elif repo in self.configs:
            self._reply(200, self.configs[repo])
        else:
            self._reply(404, {"error": "not found"})

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class OperatorProcess:
    """`python -m goodput_operator` as its own process, logging to a file."""

    def __init__(self, kubeconfig: Path, log: Path, hub_endpoint: str, *args: str) -> None:
        self.kubeconfig, self.log_path, self.hub_endpoint, self.args = kubeconfig, log, hub_endpoint, args
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "RUNTIME_IMAGE": RUNTIME_IMAGE,
            "HF_ENDPOINT": self.hub_endpoint,
            "RESYNC_SECONDS": "10",
            "DISCOVERY_SECONDS": "2",
            "HUB_TIMEOUT_SECONDS": "5",
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "goodput_operator", "--liveness-port", "0", "--metrics-port", "0", *self.args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        wait_for(
            lambda: "Watching InferenceServices" in self.log() or self.process.poll() is not None,
            60,
            "the operator to start",
        )
        assert self.process.poll() is None, self.log()[-4000:]
        return self

    def stop(self) -> None:
        if self.process:
            helpers.stop_process(self.process, timeout=30)

    def __enter__(self) -> OperatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        """Stopped; a traceback in its log is printed, to be seen beside the test that failed."""
        self.stop()
        if "Traceback" in self.log():
            print(self.log()[-6000:])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
