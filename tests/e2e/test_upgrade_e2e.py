"""An upgrade under load on a real node: the operator and gateways roll to a new version while steady
traffic runs through the gateway, and not one request fails.

`kubectl apply -k manifests/` installed Goodput (the `installed` fixture). Two InferenceServices
serve the tiny model. Four clients send chat completions, half of them streamed, to the gateway's
ClusterIP, each on a fresh connection, without pause. The upgrade is the chart rendered by Helm's own
library with `images.operator.tag` set to a new version (the operator's image, tagged again under
that version in the node's containerd) and applied: the operator, the serving gateways and the
batch gateway roll to it. Then the same again back to the installed version (the downgrade, which
also leaves the cluster as the other tests expect it).

The second test (marked `extended`: `make test-extended`) hands the install to Helm (the kustomize
objects deleted, the CRDs, the namespace, the services and the batch store's claim kept), installs
the chart with Helm's own library, asks both services through the release's gateway, and runs
`helm upgrade` to the new version under the same load; it puts the kustomize install back at the end.

Asserted, each way: zero failed requests (any status but 200, a stream without its `[DONE]`, a
reset connection); the services and their runtime Deployments never re-created (same uids); the
runtime pods neither replaced nor restarted (their template did not change); the services Ready
again at their current generation; the gateways and the operator on the new image.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import helm_python as helm
import pytest
import yaml
from node import OPERATOR_IMAGE, OPERATOR_NAMESPACE, ROOT, Node, chat, cluster_ip, condition, run, wait_for

SERVICES = ("up-a", "up-b")
CLIENTS = 4
NEXT_TAG = "upgrade-next"
ROLLOUTS = ("goodput-operator", "goodput-gateway", "goodput-gateway-batch")
SETTLE_SECONDS = 10  # traffic goes on after the rollouts, while the old gateway pods drain and go


def service(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "serving.goodput.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "pvc://models/tiny", "servedName": name, "maxModelLen": 256, "dtype": "float32"},
            "engine": {"maxNumSeqs": 8, "maxBatchedTokens": 256},
            "resources": {"gpu": 0, "cpu": "500m", "memory": "1Gi"},
            # loose targets: the runtime's admission refuses (429) what would miss them, and this test
            # counts every refusal; the machine's other load must not read as a failed upgrade
            "slo": {"ttft": "60s", "tpot": "10s"},
        },
    }


@dataclass
class Load:
    """Steady traffic through the gateway from CLIENTS threads; every outcome counted."""

    host: str
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def one(self, model: str, stream: bool, n: int) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"count to {n}"}],
            "max_tokens": 8,
            "temperature": 0,
            "stream": stream,
        }
        conn = http.client.HTTPConnection(self.host, 80, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")
            if stream and b"data: [DONE]" not in data:
                raise RuntimeError(f"a stream ended without [DONE]: {data[-200:]!r}")
            if not stream:
                json.loads(data)["choices"][0]["message"]
        finally:
            conn.close()

    def client(self, index: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            model, stream = SERVICES[(index + n) % 2], n % 2 == 0
            try:
                self.one(model, stream, n)
            except Exception as err:  # every way a request can fail counts
                with self.lock:
                    self.failures.append(f"{time.strftime('%H:%M:%S')} {model} stream={stream}: {err!r}")
            else:
                with self.lock:
                    self.ok += 1

    @classmethod
    @contextlib.contextmanager
    def running(cls, host: str) -> Iterator[Load]:
        load = cls(host)
        threads = [threading.Thread(target=load.client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        try:
            yield load
        finally:
            load.stop.set()
            for t in threads:
                t.join(timeout=150)


def chart_objects(tag: str) -> str:
    """The chart with its default values but the operator's image tag, rendered by Helm's own code."""
    with helm.Chart.load(ROOT / "charts" / "goodput") as chart:
        out = chart.render({"images": {"operator": {"tag": tag}}}, name="goodput", namespace=OPERATOR_NAMESPACE)
    return "\n---\n".join(text for path, text in sorted(out.items()) if path.endswith(".yaml"))


def apply_version(node: Node, tag: str) -> None:
    kubectl = shutil.which("kubectl")
    assert kubectl, "needs a kubectl >= 1.21 on the PATH"
    rendered = chart_objects(tag)
    if "policy/v1" not in node.kubectl("api-versions", kubectl=kubectl).stdout.split():
        rendered = rendered.replace("apiVersion: policy/v1\n", "apiVersion: policy/v1beta1\n")  # before 1.21
    node.kubectl("apply", "-f", "-", input_text=rendered, kubectl=kubectl)
    for name in ROLLOUTS:
        node.kubectl("rollout", "status", f"deployment/{name}", "-n", OPERATOR_NAMESPACE, "--timeout=300s", timeout=320)


def gateway_pods(node: Node) -> list[dict[str, Any]]:
    selector = "app.kubernetes.io/name in (goodput-gateway,goodput-gateway-batch,goodput-operator)"
    return node.get("pods", namespace=OPERATOR_NAMESPACE, selector=selector) or []


def only_new_pods(node: Node, image: str) -> bool:
    pods = gateway_pods(node)
    return bool(pods) and all(
        p["spec"]["containers"][0]["image"] == image
        and not p["metadata"].get("deletionTimestamp")
        and condition(p, "Ready").get("status") == "True"
        for p in pods
    )


def runtime_state(node: Node) -> dict[str, Any]:
    """What an upgrade of the control plane must leave alone: the services, their Deployments and pods."""
    state: dict[str, Any] = {}
    for name in SERVICES:
        svc, deploy = node.get("inferenceservice", name), node.get("deployment", f"{name}-runtime")
        pods = node.get("pods", selector=f"serving.goodput.dev/service={name}") or []
        state[name] = {
            "service": svc["metadata"]["uid"],
            "deployment": deploy["metadata"]["uid"],
            "pods": sorted(
                (p["metadata"]["name"], sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses", ())))
                for p in pods
            ),
        }
    return state


def converged(node: Node) -> bool:
    for name in SERVICES:
        svc = node.get("inferenceservice", name) or {}
        if svc.get("status", {}).get("observedGeneration") != svc.get("metadata", {}).get("generation"):
            return False
        if condition(svc, "Ready").get("status") != "True":
            return False
    return True


@pytest.fixture(scope="module")
def next_version(installed: Node) -> Iterator[str]:
    """The operator's image under a new version's tag, in the node's containerd."""
    image = f"{OPERATOR_IMAGE.rsplit(':', 1)[0]}:{NEXT_TAG}"
    ctr = ["ctr", "-n", "k8s.io", "--address", installed.containerd_address, "images"]
    run([*ctr, "tag", "--force", OPERATOR_IMAGE, image], timeout=60)
    yield image
    run([*ctr, "rm", image], timeout=60)


@pytest.fixture(scope="module")
def services(installed: Node, models: Any) -> Iterator[str]:
    """Both services Ready; yields the gateway's ClusterIP."""
    node = installed
    wait_rollouts(node)
    node.apply([service(name) for name in SERVICES])
    wait_for(lambda: converged(node), 600, "both services Ready", explain=node.describe)
    yield cluster_ip(node, "goodput-gateway", OPERATOR_NAMESPACE)
    node.kubectl("delete", "inferenceservice", *SERVICES, "--wait=true", timeout=180)


def wait_rollouts(node: Node) -> None:
    for name in ROLLOUTS:
        node.kubectl("rollout", "status", f"deployment/{name}", "-n", OPERATOR_NAMESPACE, "--timeout=300s", timeout=320)


def upgrade_under_load(node: Node, host: str, upgrade: Callable[[], object], image: str, before: Any) -> None:
    """`upgrade` while the clients run; then zero failures, the services untouched and Ready."""
    with Load.running(host) as load:
        wait_for(lambda: load.ok >= 8, 120, "traffic to flow before the upgrade", explain=lambda: str(load.failures))
        started = time.monotonic()
        upgrade()
        wait_rollouts(node)
        wait_for(lambda: only_new_pods(node, image), 180, f"only {image} pods, all Ready", explain=node.describe)
        time.sleep(SETTLE_SECONDS)
        took = time.monotonic() - started
    ok, failures = load.ok, load.failures
    print(f"to {image}: {ok} requests answered, {len(failures)} failed, in {took:.0f} s")
    assert failures == [], f"{len(failures)} of {ok + len(failures)} requests failed:\n" + "\n".join(failures[:20])
    assert ok >= 20, f"only {ok} requests in {took:.0f} s: too little load to judge the rollout"
    wait_for(lambda: converged(node), 120, "both services Ready at their generation", explain=node.describe)
    assert runtime_state(node) == before  # nothing re-created, replaced or restarted


def test_an_upgrade_and_a_downgrade_under_steady_load_fail_no_request(
    installed: Node, services: str, next_version: str
) -> None:
    node = installed
    before = runtime_state(node)
    for tag, image in ((NEXT_TAG, next_version), (OPERATOR_IMAGE.rsplit(":", 1)[1], OPERATOR_IMAGE)):
        upgrade_under_load(node, services, functools.partial(apply_version, node, tag), image, before)


def kustomized_without(node: Node, kinds: tuple[str, ...]) -> str:
    kubectl = shutil.which("kubectl") or "kubectl"
    docs = yaml.safe_load_all(node.kubectl("kustomize", str(ROOT / "manifests"), kubectl=kubectl).stdout)
    text = yaml.safe_dump_all([d for d in docs if d and d["kind"] not in kinds])
    if "policy/v1" not in node.kubectl("api-versions", kubectl=kubectl).stdout.split():
        text = text.replace("apiVersion: policy/v1\n", "apiVersion: policy/v1beta1\n")  # before 1.21
    return text


@pytest.mark.extended  # README's Tests: Helm's upgrade on the control plane, serving from a Helm release under load
def test_helm_installs_serves_and_upgrades_with_no_failed_request(
    installed: Node, services: str, next_version: str
) -> None:
    """The kustomize install handed to Helm: its objects deleted (the CRDs, the namespace, the services and
    the batch store's claim kept; the claim adopted by Helm's labels), `helm install` of the chart, the
    services answering through its gateway, then `helm upgrade` to the new version under load. Afterwards
    the release is uninstalled and `kubectl apply -k manifests/` puts the kustomize install back."""
    node = installed
    before = runtime_state(node)
    kubectl = shutil.which("kubectl") or "kubectl"
    kept = ("CustomResourceDefinition", "Namespace", "PersistentVolumeClaim")
    node.kubectl("delete", "-f", "-", "--wait=true", input_text=kustomized_without(node, kept), timeout=300)
    claim = ["-n", OPERATOR_NAMESPACE, "pvc/goodput-gateway-batch", "--overwrite"]
    node.kubectl("label", *claim, "app.kubernetes.io/managed-by=Helm", kubectl=kubectl)
    node.kubectl(
        "annotate", *claim, "meta.helm.sh/release-name=goodput", f"meta.helm.sh/release-namespace={OPERATOR_NAMESPACE}"
    )
    chart = ROOT / "charts" / "goodput"
    values: dict[str, Any] = {"namespace": {"create": False}}  # the namespace is not Helm's to adopt
    try:
        with helm.Config(kubeconfig_path=str(node.kubeconfig), namespace=OPERATOR_NAMESPACE) as cfg:
            cfg.install(chart, "goodput", values, namespace=OPERATOR_NAMESPACE, timeout=300)
            wait_rollouts(node)
            wait_for(
                lambda: only_new_pods(node, OPERATOR_IMAGE), 180, "the release's pods Ready", explain=node.describe
            )
            host = cluster_ip(node, "goodput-gateway", OPERATOR_NAMESPACE)  # the Service is the release's now
            for name in SERVICES:  # the Helm install serves what was there
                wait_for(
                    lambda name=name: chat(host, name, "hello"),
                    60,
                    f"{name} to answer through the release's gateway",
                    ignore=(OSError, RuntimeError),
                )
            upgrade = {**values, "images": {"operator": {"tag": NEXT_TAG}}}
            upgrade_under_load(
                node, host, lambda: cfg.upgrade(chart, "goodput", upgrade, timeout=300), next_version, before
            )
            assert [r["revision"] for r in cfg.history("goodput")] == [1, 2]
            cfg.uninstall("goodput", timeout=300)
    finally:
        node.apply_kustomization(ROOT / "manifests")
        wait_rollouts(node)


def test_the_chart_renders_the_installed_objects_but_the_new_image() -> None:
    """The upgrade's objects are the installed manifests with one change: the operator's image tag."""
    old = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(chart_objects("0")) if o}
    new = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(chart_objects(NEXT_TAG)) if o}
    assert old.keys() == new.keys()
    changed = sorted(k for k in old if old[k] != new[k])
    assert changed == [("Deployment", name) for name in sorted(ROLLOUTS)]
