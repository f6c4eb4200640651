"""The one-node cluster of the e2e tier: bring-up, images, kubectl and HTTP helpers."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = ROOT / "hack" / "cluster.sh"
IMAGES_SCRIPT = ROOT / "hack" / "images.sh"
RUNTIME_IMAGE = "ghcr.io/goodput-dev/goodput-runtime:0.1.0"
OPERATOR_IMAGE = "ghcr.io/goodput-dev/goodput-operator:0.1.0"
OPERATOR_NAMESPACE = "goodput-system"


def node_unsupported() -> str | None:
    """Why this machine cannot run the node, or None."""
    if os.geteuid() != 0:
        return "the one-node cluster needs root (containerd, iptables, cgroups)"
    try:
        release = Path("/etc/os-release").read_text()
    except OSError:
        return "no /etc/os-release: the one-node cluster is written for Debian or Ubuntu"
    if not re.search(r"^(ID|ID_LIKE)=.*(debian|ubuntu)", release, re.MULTILINE | re.IGNORECASE):
        return "the one-node cluster is written for Debian or Ubuntu"
    return None


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    return result.stdout


def cache_root() -> Path:
    """hack/cluster.sh's cache folder, where it records which cluster owns this machine's node."""
    if os.environ.get("GOODPUT_CACHE"):
        return Path(os.environ["GOODPUT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "goodput"


@dataclass
class Node:
    """A running control plane plus this machine as its one node.

    `dir` is the cluster's own folder; `scratch` is this test session's (models, kubeconfig).
    A node `borrowed` from a cluster that already ran (the demo's, say) is left running: the
    session keeps to its own namespace and removes what it made.
    """

    dir: Path
    kubeconfig: Path
    containerd_address: str
    bin: Path
    scratch: Path
    borrowed: bool = False
    env: dict[str, str] = field(default_factory=dict)
    namespace: str = ""  # the one use_namespace made the default

    @classmethod
    def _from_exports(cls, cluster_dir: Path, exports_text: str, scratch: Path, borrowed: bool) -> Node:
        exports = dict(re.findall(r"export (\w+)=(\S+)", exports_text))
        node = cls(
            cluster_dir,
            Path(exports["KUBECONFIG"]),
            exports["CONTAINERD_ADDRESS"],
            Path((cluster_dir / "bin").read_text().strip()),
            scratch,
            borrowed,
        )
        node.env = {**os.environ, "KUBECONFIG": str(node.kubeconfig), "CONTAINERD_ADDRESS": node.containerd_address}
        return node

    @classmethod
    def up(cls, workdir: Path) -> Node:
        out = run([str(CLUSTER_SCRIPT), "up", "--node", "--dir", str(workdir)], timeout=3600)
        return cls._from_exports(workdir, out, workdir, borrowed=False)

    @classmethod
    def running(cls, scratch: Path) -> Node | None:
        """The one-node cluster already running on this machine (hack/cluster.sh allows one), if any."""
        owner = cache_root() / "node-owner"
        if not owner.is_file():
            return None
        cluster_dir = Path(owner.read_text().strip())
        result = subprocess.run(
            [str(CLUSTER_SCRIPT), "env", "--dir", str(cluster_dir)], capture_output=True, text=True, timeout=60
        )
        if result.returncode != 0 or "CONTAINERD_ADDRESS" not in result.stdout:
            return None
        return cls._from_exports(cluster_dir, result.stdout, scratch, borrowed=True)

    def use_namespace(self, namespace: str) -> None:
        """Create `namespace` and make it the default of every later kubectl call (a kubeconfig of our own)."""
        own = self.scratch / "e2e.kubeconfig"
        if self.kubeconfig != own:  # a node shared by several modules has its own already
            shutil.copyfile(self.kubeconfig, own)
            self.kubeconfig = own
        self.env["KUBECONFIG"] = str(own)
        wait_for(
            lambda: not (self.get("namespace", namespace) or {}).get("metadata", {}).get("deletionTimestamp"),
            300,
            f"namespace {namespace} left over from an earlier run to finish terminating",
        )
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        self.kubectl("config", "set-context", "--current", f"--namespace={namespace}")
        self.namespace = namespace

    def remove(self, namespace: str, *cluster_objects: str, wait: bool = True) -> None:
        """Delete `namespace` with everything in it, then cluster-scoped objects (`kind/name`); waits for
        both unless `wait` is false. Its pods go at once (no grace period: nothing of theirs is wanted), once
        the namespace is terminating and nothing can re-create them."""
        self.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false", timeout=120)
        self.kubectl(
            "delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force", "--wait=false", check=False
        )
        if wait:
            wait_for(lambda: not self.get("namespace", namespace), 600, f"namespace {namespace} gone")
        else:  # the gateway routes by served name across namespaces: none of this one's may linger there
            wait_for(
                lambda: not self.get("inferenceservices,inferencepipelines", namespace=namespace),
                120,
                f"the services of namespace {namespace} gone",
            )
        for obj in cluster_objects:
            self.kubectl("delete", obj, "--ignore-not-found", f"--wait={str(wait).lower()}", timeout=120)

    def down(self) -> None:
        subprocess.run([str(CLUSTER_SCRIPT), "down", "--dir", str(self.dir)], capture_output=True, timeout=300)

    def load_images(self) -> None:
        """Build both images from the project's Dockerfiles (cached when unchanged) and import them."""
        run([str(IMAGES_SCRIPT), "all"], timeout=3600, env=self.env)

    def kubectl(
        self,
        *args: str,
        input_text: str | None = None,
        check: bool = True,
        timeout: float = 120,
        kubectl: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        own = self.bin / "kubectl"
        cmd = [
            kubectl or (str(own) if own.exists() else "kubectl"),
            "--kubeconfig",
            str(self.kubeconfig),
            "--cache-dir",
            str(self.scratch / "kubectl-cache"),
            *args,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, input=input_text, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    def apply_kustomization(self, path: Path) -> None:
        """`kubectl apply -k` with the kubectl on the PATH: the node's own 1.20 kubectl embeds a
        kustomize too old for today's kustomization files."""
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            raise AssertionError("`kubectl apply -k` needs a kubectl >= 1.21 on the PATH")
        rendered = self.kubectl("kustomize", str(path), kubectl=kubectl).stdout
        if "policy/v1" not in self.kubectl("api-versions", kubectl=kubectl).stdout.split():
            rendered = rendered.replace("apiVersion: policy/v1\n", "apiVersion: policy/v1beta1\n")  # before 1.21
        self.kubectl("apply", "-f", "-", input_text=rendered, kubectl=kubectl)

    def get(self, kind: str, name: str = "", namespace: str | None = None, selector: str = "") -> Any:
        """The object as JSON; None when it does not exist (or a List's items with a selector). In the
        kubeconfig's namespace unless `namespace` is given."""
        args = ["get", kind, *([name] if name else []), *(["-n", namespace] if namespace else []), "-o", "json"]
        if selector:
            args += ["-l", selector]
        result = self.kubectl(*args, check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr:
                return None
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr}")
        data = json.loads(result.stdout)
        return data["items"] if data.get("kind", "").endswith("List") else data

    def apply(self, manifest: dict[str, Any] | list[dict[str, Any]]) -> None:
        items = manifest if isinstance(manifest, list) else [manifest]
        self.kubectl("apply", "-f", "-", input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))

    def describe(self, namespace: str | None = None) -> str:
        """What to print when a wait fails: pods, events and the operator's log tail."""
        parts = []
        ns = ["-n", namespace] if namespace else []
        for args in (
            ["get", "pods,rs,deploy,gsvc", *ns, "-o", "wide"],
            ["get", "events", *ns, "--sort-by=.lastTimestamp"],
            ["logs", "-n", OPERATOR_NAMESPACE, "deploy/goodput-operator", "--tail=40"],
        ):
            result = self.kubectl(*args, check=False)
            parts.append(f"$ kubectl {' '.join(args)}\n{result.stdout[-4000:]}{result.stderr[-1000:]}")
        return "\n".join(parts)


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in (obj or {}).get("status", {}).get("conditions") or ():
        if c.get("type") == type_:
            return dict(c)
    return {}


def cluster_ip(node: Node, service: str, namespace: str | None = None) -> str:
    svc = node.get("service", service, namespace)
    assert svc is not None, f"no Service {service}"
    return str(svc["spec"]["clusterIP"])


def chat(
    host: str,
    model: str,
    content: str,
    max_tokens: int = 8,
    port: int = 80,
    conn: http.client.HTTPConnection | None = None,
    timeout: float = 60,
) -> dict[str, Any]:
    """One non-streamed chat completion; raises on anything but 200."""
    conn = conn or http.client.HTTPConnection(host, port, timeout=timeout)
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
    )
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data[:300]!r}")
    return dict(json.loads(data))


def copy_model(src: Path, dest: Path) -> Path:
    """A copy readable by the runtime's non-root user (the hostPath volume keeps file modes)."""
    shutil.copytree(src, dest, dirs_exist_ok=True)
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest
