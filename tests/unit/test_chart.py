"""The Helm chart (charts/goodput), rendered, checked and packaged with Helm's own library (helm-python-sdk):
its values reach the objects they name, a wrong value is refused naming the field, and manifests/, the
chart's CRDs and its version are derived from one source each. Installing it is the operator tier's job
(tests/operator/test_chart_install.py)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from goodput_contract.version import VERSION

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "goodput"
NS = "goodput-system"


def _chart_script() -> Any:
    spec = importlib.util.spec_from_file_location("chart_script", ROOT / "hack" / "chart.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["chart_script"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out = chart.render(values or {}, name="goodput", namespace=NS, is_install=True)
    return [doc for path, text in out.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"no {kind} {name} in {[(o['kind'], o['metadata']['name']) for o in objects]}")


def container(objects: list[dict[str, Any]], deployment: str) -> dict[str, Any]:
    (c,) = find(objects, "Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return c


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def test_manifests_crds_and_version_are_derived_and_current():
    """manifests/*.yaml are the chart's templates rendered with no values, the chart's crds/ are the
    repository's crds/, Chart.yaml carries goodput_contract's VERSION; `hack/chart.py sync` fixes each."""
    problems = _chart_script().check()
    assert problems == [], "\n".join(problems) + "\nrun `python3 hack/chart.py sync`"


def test_kustomization_installs_exactly_the_rendered_templates():
    kustomization = yaml.safe_load((ROOT / "manifests" / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == NS
    assert kustomization["resources"] == ["../crds", *_chart_script().RENDERED]
    crds = yaml.safe_load((ROOT / "crds" / "kustomization.yaml").read_text())["resources"]
    assert sorted(crds) == sorted(p.name for p in (CHART / "crds").glob("*.yaml"))


def test_the_version_is_stamped_everywhere_the_images_are_named(chart):
    assert chart.version == VERSION and chart.metadata["appVersion"] == VERSION
    pyproject = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert pyproject and pyproject[1] == VERSION, "pyproject.toml's version differs from goodput_contract's VERSION"
    objects = render(chart)
    assert container(objects, "goodput-operator")["image"] == f"ghcr.io/goodput-dev/goodput-operator:{VERSION}"
    assert container(objects, "goodput-gateway")["image"] == f"ghcr.io/goodput-dev/goodput-operator:{VERSION}"
    runtime = env(container(objects, "goodput-operator"))["RUNTIME_IMAGE"]
    assert runtime == f"ghcr.io/goodput-dev/goodput-runtime:{VERSION}"
    from goodput_operator.settings import DEFAULT_RUNTIME_IMAGE

    assert runtime == DEFAULT_RUNTIME_IMAGE
    names = subprocess.run([str(ROOT / "hack" / "images.sh"), "names"], capture_output=True, text=True, timeout=30)
    assert f"ghcr.io/goodput-dev/goodput-runtime:{VERSION}" in names.stdout.split()
    assert f"ghcr.io/goodput-dev/goodput-operator:{VERSION}" in names.stdout.split()
    demo = (ROOT / "hack" / "demo.sh").read_text()
    assert f"goodput-runtime:{VERSION}" in demo and f"goodput-operator:{VERSION}" in demo


def test_lint_is_clean_with_defaults_and_with_every_option():
    for values in (None, FULL):
        report = helm.lint(CHART, values, strict=True, namespace=NS)
        assert report["errors"] == [], report
        assert not [m for m in report["messages"] if m["severity"] >= 2], report


FULL: dict[str, Any] = {
    "images": {
        "operator": {"repository": "registry.example/goodput-operator", "digest": "sha256:" + "a" * 64},
        "runtime": {"repository": "registry.example/goodput-runtime", "tag": "9.9.9"},
        "pullPolicy": "Always",
        "pullSecrets": ["regcred"],
    },
    "operator": {
        "watchNamespace": "models",
        "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "nodeSelector": {"pool": "system"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
        "extraEnv": [{"name": "PROMETHEUS_URL", "value": "http://prometheus.monitoring:9090"}],
    },
    "gateway": {
        "replicas": 4,
        "maxHeldRequests": 7,
        "holdSeconds": 12.5,
        "attempts": 2,
        "auth": {"apiKeyTtlSeconds": 5},
        "maxInFlightPerReplica": 2,
        "queueSeconds": 9,
        "tenants": {"secretName": "gateway-tenants", "metricsCap": 20},
        "service": {"type": "LoadBalancer", "port": 8080},
        "nodeSelector": {"pool": "edge"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}},
        "extraEnv": [{"name": "LOG_LEVEL", "value": "DEBUG"}],
    },
    "batch": {"store": "postgresql", "postgresql": {"secretName": "batch-db", "secretKey": "dsn"}},
    "monitoring": {"enabled": True, "labels": {"release": "prom"}},
}


def test_every_value_reaches_the_object_it_names(chart):
    objects = render(chart, FULL)
    op, gw = container(objects, "goodput-operator"), container(objects, "goodput-gateway")
    assert op["image"] == "registry.example/goodput-operator@sha256:" + "a" * 64 == gw["image"]
    assert op["imagePullPolicy"] == "Always" == gw["imagePullPolicy"]
    assert env(op)["RUNTIME_IMAGE"] == "registry.example/goodput-runtime:9.9.9"
    assert env(op)["WATCH_NAMESPACE"] == "models"
    assert env(op)["PROMETHEUS_URL"] == "http://prometheus.monitoring:9090"
    assert op["resources"] == FULL["operator"]["resources"]
    op_pod = find(objects, "Deployment", "goodput-operator")["spec"]["template"]["spec"]
    assert op_pod["nodeSelector"] == {"pool": "system"}
    assert op_pod["tolerations"] == FULL["operator"]["tolerations"]
    assert op_pod["imagePullSecrets"] == [{"name": "regcred"}]

    gateway = find(objects, "Deployment", "goodput-gateway")
    assert gateway["spec"]["replicas"] == 4
    gw_pod = gateway["spec"]["template"]["spec"]
    assert gw_pod["nodeSelector"] == {"pool": "edge"}
    assert gw_pod["affinity"] == FULL["gateway"]["affinity"]
    gw_env = env(gw)
    assert gw_env["GATEWAY_MAX_HELD_REQUESTS"] == "7"
    assert gw_env["GATEWAY_HOLD_SECONDS"] == "12.5"
    assert gw_env["GATEWAY_ATTEMPTS"] == "2"
    assert gw_env["GATEWAY_API_KEY_TTL"] == "5"
    assert gw_env["GATEWAY_MAX_IN_FLIGHT_PER_REPLICA"] == "2"
    assert gw_env["GATEWAY_QUEUE_SECONDS"] == "9"
    assert gw_env["GATEWAY_TENANTS_SECRET"] == f"{NS}/gateway-tenants"
    assert gw_env["GATEWAY_TENANT_METRICS_CAP"] == "20"
    assert gw_env["LOG_LEVEL"] == "DEBUG"
    assert gw_env["GATEWAY_DATABASE"] == {"secretKeyRef": {"name": "batch-db", "key": "dsn"}}
    service = find(objects, "Service", "goodput-gateway")
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["ports"][0]["port"] == 8080

    for kind, name in (
        ("ServiceMonitor", "goodput-gateway"),
        ("PrometheusRule", "goodput"),
        ("ConfigMap", "goodput-autoscaling-dashboard"),
    ):
        obj = find(objects, kind, name)
        assert obj["metadata"]["namespace"] == NS and obj["metadata"]["labels"]["release"] == "prom"
    rule = find(objects, "PrometheusRule", "goodput")
    source = yaml.safe_load((ROOT / "manifests" / "monitoring" / "prometheus-rule.yaml").read_text())
    assert rule["spec"] == source["spec"]  # Prometheus's own {{ }} templates arrive untouched


def test_the_gateway_reads_every_setting_the_chart_gives_it(chart, monkeypatch):
    from goodput_gateway.__main__ import parser

    gw_env = env(container(render(chart, FULL), "goodput-gateway"))
    plain = {name: value for name, value in gw_env.items() if isinstance(value, str)}
    for name, value in plain.items():
        monkeypatch.setenv(name, value)
    args = parser().parse_args([])
    assert args.max_in_flight_per_replica == 2 and args.queue_seconds == 9
    assert args.tenants_secret == f"{NS}/gateway-tenants" and args.tenant_metrics_cap == 20
    assert args.max_held_requests == 7 and args.hold_seconds == 12.5 and args.attempts == 2


def test_defaults_turn_the_batch_api_on_and_leave_tenants_and_monitoring_off(chart, monkeypatch):
    from goodput_gateway.__main__ import parser

    objects = render(chart)
    serving = find(objects, "Deployment", "goodput-gateway")
    assert serving["spec"]["replicas"] == 2 and serving["spec"]["strategy"]["type"] == "RollingUpdate"
    assert "volumes" not in serving["spec"]["template"]["spec"]
    gw_env = env(container(objects, "goodput-gateway"))
    assert "GATEWAY_DATABASE" not in gw_env and "GATEWAY_TENANTS_SECRET" not in gw_env
    # the batch Service's address from the service environment variables (a cluster may have no DNS)
    assert gw_env["GATEWAY_BATCH_URL"] == (
        "http://$(GOODPUT_GATEWAY_BATCH_SERVICE_HOST):$(GOODPUT_GATEWAY_BATCH_SERVICE_PORT_HTTP)"
    )
    assert gw_env["GATEWAY_MAX_IN_FLIGHT_PER_REPLICA"] == "0"
    owner = find(objects, "Deployment", "goodput-gateway-batch")
    assert owner["spec"]["replicas"] == 1 and owner["spec"]["strategy"] == {"type": "Recreate"}
    owner_env = env(container(objects, "goodput-gateway-batch"))
    assert owner_env["GATEWAY_DATABASE"] == "sqlite:////var/lib/goodput-gateway/batch.db"
    assert "GATEWAY_BATCH_URL" not in owner_env
    assert {k: v for k, v in owner_env.items() if k != "GATEWAY_DATABASE"} == {
        k: v for k, v in gw_env.items() if k != "GATEWAY_BATCH_URL"
    }
    assert owner["spec"]["template"]["spec"]["volumes"] == [
        {"name": "batch", "persistentVolumeClaim": {"claimName": "goodput-gateway-batch"}}
    ]
    # the serving gateways reach the owner at the URL they are given, through its Service
    owner_service = find(objects, "Service", "goodput-gateway-batch")
    assert owner_service["spec"]["selector"] == owner["spec"]["template"]["metadata"]["labels"]
    assert owner_service["spec"]["ports"][0]["port"] == 80
    assert find(objects, "Service", "goodput-gateway")["spec"]["selector"] != owner_service["spec"]["selector"]
    pvc = find(objects, "PersistentVolumeClaim", "goodput-gateway-batch")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "storageClassName" not in pvc["spec"]  # the cluster's default StorageClass
    assert not [o for o in objects if o["kind"] in ("ServiceMonitor", "PrometheusRule")]
    for name, value in gw_env.items():
        monkeypatch.setenv(name, value)
    assert parser().parse_args([]).batch_url == gw_env["GATEWAY_BATCH_URL"]
    monkeypatch.delenv("GATEWAY_BATCH_URL")
    monkeypatch.setenv("GATEWAY_DATABASE", owner_env["GATEWAY_DATABASE"])
    assert parser().parse_args([]).database == owner_env["GATEWAY_DATABASE"]


def test_sqlite_store_is_one_batch_gateway_on_its_own_volume_beside_the_serving_ones(chart):
    values = {
        "gateway": {"replicas": 4, "nodeSelector": {"pool": "edge"}},
        "batch": {"sqlite": {"size": "2Gi", "storageClassName": "fast"}},
    }
    objects = render(chart, values)
    assert find(objects, "Deployment", "goodput-gateway")["spec"]["replicas"] == 4
    owner = find(objects, "Deployment", "goodput-gateway-batch")
    assert owner["spec"]["replicas"] == 1
    assert owner["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "edge"}
    pvc = find(objects, "PersistentVolumeClaim", "goodput-gateway-batch")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "2Gi" and pvc["spec"]["storageClassName"] == "fast"
    claimed = render(chart, {"batch": {"sqlite": {"existingClaim": "mine"}}})
    assert not [o for o in claimed if o["kind"] == "PersistentVolumeClaim"]
    assert find(claimed, "Deployment", "goodput-gateway-batch")["spec"]["template"]["spec"]["volumes"][0][
        "persistentVolumeClaim"
    ] == {"claimName": "mine"}


@pytest.mark.parametrize("store", ["none", "postgresql"])
def test_without_sqlite_there_is_no_batch_gateway_and_no_volume(chart, store):
    values: dict[str, Any] = {"batch": {"store": store}}
    if store == "postgresql":
        values["batch"]["postgresql"] = {"secretName": "batch-db"}
    objects = render(chart, values)
    assert not [o for o in objects if o["metadata"]["name"] == "goodput-gateway-batch"]
    gw_env = env(container(objects, "goodput-gateway"))
    assert "GATEWAY_BATCH_URL" not in gw_env
    assert ("GATEWAY_DATABASE" in gw_env) == (store == "postgresql")


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"batch": {"store": "postgresql"}}, "batch.postgresql.secretName"),
        # settings of a store not chosen would be ignored: refused instead
        (
            {"batch": {"postgresql": {"secretName": "db"}}},
            "batch.postgresql.secretName: set, but batch.store is sqlite",
        ),
        ({"batch": {"store": "none", "sqlite": {"storageClassName": "fast"}}}, "batch.sqlite"),
        (
            {"batch": {"store": "postgresql", "postgresql": {"secretName": "db"}, "sqlite": {"existingClaim": "x"}}},
            "batch.sqlite",
        ),
    ],
)
def test_a_store_without_what_it_needs_is_refused_naming_the_field(chart, values, named):
    with pytest.raises(helm.HelmRenderError, match=re.escape(named)):
        render(chart, values)


@pytest.mark.parametrize(
    ("values", "path"),
    [
        ({"gateway": {"replicas": "two"}}, "/gateway/replicas"),
        ({"gateway": {"holdSeconds": "long"}}, "/gateway/holdSeconds"),
        ({"images": {"operator": {"tag": 1}}}, "/images/operator/tag"),
        ({"images": {"runtime": {"digest": "latest"}}}, "/images/runtime/digest"),
        # a tag beside a digest would be ignored: refused instead
        ({"images": {"runtime": {"tag": "1.0", "digest": "sha256:" + "b" * 64}}}, "/images/runtime/tag"),
        ({"images": {"pullPolicy": "Sometimes"}}, "/images/pullPolicy"),
        ({"operator": {"resources": {"limits": {"memory": "lots"}}}}, "/operator/resources/limits/memory"),
        ({"operator": {"nodeSelector": {"pool": 3}}}, "/operator/nodeSelector/pool"),
        ({"operator": {"watchNamespace": "Not_A_Name"}}, "/operator/watchNamespace"),
        ({"batch": {"store": "mysql"}}, "/batch/store"),
        ({"monitoring": {"enabled": "yes"}}, "/monitoring/enabled"),
        ({"gateway": {"auth": {"apiKeyTtlSeconds": -1}}}, "/gateway/auth/apiKeyTtlSeconds"),
        ({"gateway": {"maxInFlightPerReplica": -1}}, "/gateway/maxInFlightPerReplica"),
        ({"gateway": {"queueSeconds": 0}}, "/gateway/queueSeconds"),
        ({"gateway": {"tenants": {"secretName": "Tenants_Secret"}}}, "/gateway/tenants/secretName"),
        # a misspelt key is refused, not ignored
        ({"gateway": {"replica": 3}}, "/gateway"),
    ],
)
def test_schema_refuses_a_wrong_value_naming_the_field(chart, values, path):
    with pytest.raises(helm.HelmValuesError) as refused:
        chart.validate_schema(values)
    assert f"at '{path}'" in str(refused.value)
    with pytest.raises(helm.HelmValuesError, match=re.escape(path)):  # and so does an install's rendering
        render(chart, values)


def test_package_is_the_versioned_chart(tmp_path, chart):
    archive = Path(helm.package(CHART, destination=tmp_path))
    assert archive.name == f"goodput-{VERSION}.tgz"
    with helm.Chart.load_archive(archive.read_bytes()) as packed:
        assert render(packed) == render(chart)
        assert {c["name"] for c in packed.crds} == {c["name"] for c in chart.crds}


def test_every_object_lands_in_the_release_namespace(chart):
    out = chart.render({"monitoring": {"enabled": True}}, name="goodput", namespace="elsewhere", is_install=True)
    objects = [doc for path, text in out.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    assert {o["metadata"]["namespace"] for o in objects if o["kind"] not in cluster_scoped} == {"elsewhere"}
    assert find(objects, "Namespace", "elsewhere")
    for binding in (o for o in objects if o["kind"] == "ClusterRoleBinding"):
        assert [s["namespace"] for s in binding["subjects"]] == ["elsewhere"]
    assert "goodput-system" not in "".join(out.values())


def test_notes_tell_where_it_went_and_whether_batch_is_on(chart):
    notes = chart.render({}, name="goodput", namespace="models-sys")["goodput/templates/NOTES.txt"]
    assert "port-forward svc/goodput-gateway 8000:80" in notes and "-n models-sys" in notes
    assert "The Batch API is on, its store sqlite" in notes
    off = {"batch": {"store": "none"}}
    assert "The Batch API is off" in chart.render(off, name="g", namespace="n")["goodput/templates/NOTES.txt"]
