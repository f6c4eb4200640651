"""The operator under load: thousands of InferenceServices on the project's own control plane.

    python -m bench.operator_scale --services 2000 --probes 20

On a fresh control plane (hack/cluster.sh: etcd, kube-apiserver, kube-controller-manager;
no nodes, so pods stay Pending) the script measures, against one operator process:

1. probes on the empty cluster: ``kubectl apply`` of a new service, then the time until its
   Deployment exists (the baseline);
2. from nothing: --services services created while the operator is stopped, then the operator
   started; the time until every one has its Deployment and a status;
3. probes again with every service present, spread over the resync cycle;
4. the writes one resync of unchanged services makes, from the API server's own request counters
   (apiserver_request_total, every client), between two resyncs the operator reports finished,
   in the first such window in which the controller-manager wrote nothing (it has caught up), and
   the writes the operator's resync passes themselves sent (`goodput_operator_api_writes_total`
   with `trigger="resync"`) over all those windows;
5. the operator's RSS (VmRSS), sampled every second; the peak is reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from bench.scale_cluster import ROOT, ControlPlane, Operator
from bench.serve import write_json
from bench.stats import percentile

CRD = ROOT / "crds" / "serving.goodput.dev_inferenceservices.yaml"
GROUP, VERSION, PLURAL = "serving.goodput.dev", "v1alpha1", "inferenceservices"
RESULTS = ROOT / "bench" / "results"
CONTROLLER_KINDS = {"deployments", "replicasets", "pods", "endpointslices", "endpoints"}  # the controller-manager's


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--services", type=int, default=2000)
    p.add_argument("--probes", type=int, default=20, help="new services applied with every service present")
    p.add_argument("--empty-probes", type=int, default=5, help="new services applied on the empty cluster")
    p.add_argument("--probe-gap", type=float, default=1.5, help="seconds between probes")
    p.add_argument("--resync-seconds", type=float, default=30.0)
    p.add_argument(
        "--settle-windows",
        type=int,
        default=8,
        help="resync windows to wait through at most for the controller-manager to catch up",
    )
    p.add_argument("--deadline", type=float, default=900.0, help="seconds to wait for the initial reconcile")
    p.add_argument("--cluster-dir", type=Path, default=None, help="default: a fresh temporary directory")
    p.add_argument("--keep-cluster", action="store_true")
    p.add_argument("--output", type=Path, default=None)
    return p


def service_spec(i: int) -> dict[str, Any]:
    return {"model": {"source": f"file:///models/m{i}"}, "resources": {"gpu": 0, "memory": "1Gi"}, "replicas": 1}


def manifest(namespace: str, name: str, i: int) -> str:
    return json.dumps(
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace},
            "spec": service_spec(i),
        }
    )


def probe(plane: ControlPlane, namespace: str, name: str, i: int, timeout: float = 120.0) -> float:
    """Seconds from `kubectl apply` returning to the service's Deployment existing."""
    plane.kubectl("apply", "-f", "-", input_text=manifest(namespace, name, i))
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            plane.apps.read_namespaced_deployment(f"{name}-runtime", namespace, _request_timeout=10)
            return time.monotonic() - started
        except ApiException as err:
            if err.status != 404:
                raise
        time.sleep(0.02)
    return float("inf")


def run_probes(plane: ControlPlane, namespace: str, prefix: str, count: int, gap: float) -> list[float]:
    latencies = []
    for k in range(count):
        latencies.append(probe(plane, namespace, f"{prefix}-{k:03d}", 100_000 + k))
        print(f"    probe {k + 1}/{count}: {latencies[-1]:.3f} s", flush=True)
        time.sleep(gap)
    return latencies


METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


def count_reconciled(plane: ControlPlane, namespace: str, expected: int) -> tuple[int, int]:
    """(Deployments, services with a status) in the namespace. Light on the control plane it measures:
    the Deployments are counted from a metadata-only list out of the API server's watch cache, and
    the services (whole objects, for their status) are listed only once every Deployment exists."""
    request = plane.api.param_serialize(
        "GET",
        f"/apis/apps/v1/namespaces/{namespace}/deployments",
        query_params=[("resourceVersion", "0")],
        header_params={"Accept": METADATA_ONLY},
        auth_settings=["BearerToken"],
    )
    deployments = plane.api.call_api(*request, _request_timeout=60)
    n_deploy = len(json.loads(deployments.read()).get("items") or ())  # an empty list comes as null
    if n_deploy < expected:
        return n_deploy, 0
    services = plane.custom.list_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, _preload_content=False, _request_timeout=60
    )
    n_status = sum(
        1 for item in json.loads(services.data)["items"] if (item.get("status") or {}).get("observedGeneration")
    )
    return n_deploy, n_status


def summary(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values) if values else None}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    workdir = args.cluster_dir or Path(tempfile.mkdtemp(prefix="goodput-scale-"))
    print(f"control plane in {workdir} ...", flush=True)
    plane = ControlPlane(workdir)
    operator: Operator | None = None
    result: dict[str, Any] = {
        "kind": "operator_scale",
        "services": args.services,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        plane.kubectl("apply", "-f", str(CRD))
        for attempt in range(10):  # kubectl wait fails outright while the new CRD has no conditions yet
            try:
                plane.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}")
                break
            except RuntimeError:
                if attempt == 9:
                    raise
                time.sleep(1.0)
        for ns in ("scale", "probe"):
            plane.core.create_namespace({"metadata": {"name": ns}})
        shutil.rmtree(workdir / "kcache", ignore_errors=True)
        log = workdir / "operator.log"
        operator = Operator(plane, log, args.resync_seconds)
        operator.wait_started()
        print("probes on the empty cluster:", flush=True)
        result["empty_probe_s"] = run_probes(plane, "probe", "empty", args.empty_probes, args.probe_gap)
        operator.stop()

        print(f"creating {args.services} services with the operator stopped ...", flush=True)
        created = time.monotonic()

        def create(i: int) -> None:
            body = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "InferenceService",
                "metadata": {"name": f"svc-{i:05d}"},
                "spec": service_spec(i),
            }
            plane.custom.create_namespaced_custom_object(GROUP, VERSION, "scale", PLURAL, body, _request_timeout=60)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(create, range(args.services)))
        result["create_s"] = time.monotonic() - created
        print(f"  created in {result['create_s']:.1f} s; starting the operator", flush=True)

        operator = Operator(plane, log, args.resync_seconds)
        started = time.monotonic()
        operator.wait_started()
        n_deploy = n_status = 0
        while time.monotonic() - started < args.deadline:
            n_deploy, n_status = count_reconciled(plane, "scale", args.services)
            print(
                f"  {time.monotonic() - started:6.1f} s: {n_deploy} Deployments, {n_status} statuses "
                f"(RSS {operator.rss_last / 2**20:.0f} MiB)",
                flush=True,
            )
            if n_deploy >= args.services and n_status >= args.services:
                break
            time.sleep(3.0)
        result["from_nothing_s"] = time.monotonic() - started
        result["from_nothing_done"] = n_deploy >= args.services and n_status >= args.services
        result["from_nothing_reconciled"] = min(n_deploy, n_status)
        # what the pass cost the operator itself, independent of how much CPU this machine could give it
        result["from_nothing_operator_cpu_s"] = operator.cpu_seconds()

        print(f"probes with {args.services} services present:", flush=True)
        result["loaded_probe_s"] = run_probes(plane, "probe", "loaded", args.probes, args.probe_gap)

        print("writes of one resync of unchanged services:", flush=True)
        first = operator.metric("goodput_operator_resyncs_total")
        deadline = time.monotonic() + (args.settle_windows + 2) * args.resync_seconds + 300
        while operator.metric("goodput_operator_resyncs_total") < first + 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        # one window between two resyncs after another, until the controller-manager has caught up (a
        # window in which it wrote no Deployment, ReplicaSet, Pod or EndpointSlice): what the operator
        # writes then is what a resync of unchanged services costs
        windows: list[dict[str, float]] = []
        resync_writes_before = operator.metric("goodput_operator_api_writes_total", 'trigger="resync"')
        for _ in range(args.settle_windows):
            before = plane.write_counts()
            mark = operator.metric("goodput_operator_resyncs_total")
            while operator.metric("goodput_operator_resyncs_total") < mark + 1 and time.monotonic() < deadline:
                time.sleep(0.5)
            after = plane.write_counts()
            windows.append({k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)})
            print(f"  window {len(windows)}: {windows[-1] or 'no writes'}", flush=True)
            if not any(k.split("/")[0] in CONTROLLER_KINDS for k in windows[-1]) or time.monotonic() > deadline:
                break
        resync_writes_after = operator.metric("goodput_operator_api_writes_total", 'trigger="resync"')
        result["resync_seconds_last"] = operator.metric("goodput_operator_resync_duration_seconds")
        result["resync_windows"] = windows
        result["resync_writes"] = windows[-1]
        result["resync_settled"] = not any(k.split("/")[0] in CONTROLLER_KINDS for k in windows[-1])
        result["resync_write_total"] = sum(result["resync_writes"].values())
        result["resync_operator_writes"] = resync_writes_after - resync_writes_before
        result["operator_writes_total"] = operator.metric("goodput_operator_api_writes_total")
        result["rss_peak_mib"] = operator.rss_peak / 2**20
        result["rss_end_mib"] = operator.rss_last / 2**20
    finally:
        if operator is not None:
            operator.stop()
        if not args.keep_cluster:
            plane.down()
            shutil.rmtree(workdir, ignore_errors=True)

    result["empty"] = summary(result.get("empty_probe_s", []))
    result["loaded"] = summary(result.get("loaded_probe_s", []))
    path = write_json(
        args.output or RESULTS / f"operator-scale-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json", result
    )
    print(render(result))
    print(f"\nwrote {path}")
    return result


def render(r: dict) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    e, loaded = r["empty"], r["loaded"]
    return "\n".join(
        [
            f"{'measure':<44}{'value':>12}{'target':>12}",
            f"{'apply → Deployment, empty cluster, p50 (s)':<44}{s(e['p50']):>12}{'':>12}",
            f"{'apply → Deployment, empty cluster, p99 (s)':<44}{s(e['p99']):>12}{'':>12}",
            f"{'apply → Deployment, N present, p50 (s)':<44}{s(loaded['p50']):>12}{'< 0.5':>12}",
            f"{'apply → Deployment, N present, p99 (s)':<44}{s(loaded['p99']):>12}{'< 1':>12}",
            f"{'N reconciled from nothing (s)':<44}{s(r.get('from_nothing_s')):>12}{'< 120':>12}",
            f"{'operator RSS peak (MiB)':<44}{s(r.get('rss_peak_mib')):>12}{'< 300':>12}",
            f"{'writes by the resync passes (operator)':<44}{s(r.get('resync_operator_writes')):>12}{'0':>12}",
            f"{'writes, every client, last window':<44}{s(r.get('resync_write_total')):>12}{'':>12}",
            f"{'  (the controller-manager had caught up)':<44}{r.get('resync_settled', '-')!s:>12}{'':>12}",
            f"{'last resync of every service (s)':<44}{s(r.get('resync_seconds_last')):>12}{'':>12}",
            f"{'operator CPU for the pass from nothing (s)':<44}{s(r.get('from_nothing_operator_cpu_s')):>12}{'':>12}",
            f"{'services reconciled by then':<44}{r.get('from_nothing_reconciled', 0):>12}{'':>12}",
            f"N = {r['services']}",
        ]
    )


if __name__ == "__main__":
    main()
