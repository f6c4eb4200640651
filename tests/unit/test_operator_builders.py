"""The children an InferenceService turns into, compared as plain dicts."""

from goodput_contract.api.spec import parse
from goodput_operator.builders import (
    RUNTIME_DRAIN_SECONDS,
    SHUTDOWN_DELAY_SECONDS,
    build_deployment,
    build_pdb,
    build_pod_monitor,
    build_service,
    build_service_monitor,
    owner_reference,
    runtime_args,
)
from goodput_operator.settings import Settings
from goodput_runtime.__main__ import build_parser

OWNER = owner_reference("chat", "0000-uid")
SETTINGS = Settings(runtime_image="registry.local/goodput-runtime:test")
FULL = {
    "model": {
        "source": "hf://Qwen/Qwen2.5-7B-Instruct",
        "revision": "v1",
        "servedName": "qwen",
        "maxModelLen": 8192,
        "dtype": "bfloat16",
        "quantization": "int8",
        "tokenSecretRef": {"name": "hf-token", "key": "token"},
    },
    "engine": {
        "maxNumSeqs": 128,
        "maxBatchedTokens": 4096,
        "prefixCaching": True,
        "gpuMemoryUtilization": 0.85,
        "maxQueue": 64,
        "extraArgs": ["--seed", "7"],
    },
    "parallelism": {"tensor": 2},
    "resources": {"gpu": 2, "cpu": "8", "memory": "64Gi", "gpuProduct": "NVIDIA-L4"},
    "slo": {"ttft": "500ms", "tpot": "50ms", "attainment": 0.95},
    "replicas": 3,
    "template": {"tolerations": [{"key": "gpu", "operator": "Exists"}], "priorityClassName": "serving"},
}


def test_runtime_command_line_is_derived_from_the_spec():
    assert runtime_args(parse("chat", "ns", FULL)) == [
        "--model",
        "Qwen/Qwen2.5-7B-Instruct",
        "--served-model-name",
        "qwen",
        "--revision",
        "v1",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "8192",
        "--max-num-seqs",
        "128",
        "--max-num-batched-tokens",
        "4096",
        "--gpu-memory-utilization",
        "0.85",
        "--enable-prefix-caching",
        "--max-queue",
        "64",
        "--slo-ttft",
        "0.5",
        "--slo-tpot",
        "0.05",
        "--tensor-parallel-size",
        "2",
        "--quantization",
        "int8",
        "--shutdown-delay",
        "5",
        "--seed",
        "7",
    ]


def test_one_gguf_file_of_a_hub_repository_reaches_the_runtime_as_an_hf_url():
    spec = {"model": {"source": "hf://acme/tiny-GGUF/tiny.Q4_K_M.gguf", "quantization": "int8-w8a8"}}
    args = build_parser().parse_args(runtime_args(parse("chat", "ns", spec)))
    assert (args.model, args.revision, args.quantization) == (
        "hf://acme/tiny-GGUF/tiny.Q4_K_M.gguf",
        "main",
        "int8-w8a8",
    )


def test_deployment_runs_tensor_gpus_per_pod_with_probes_and_a_restricted_context():
    deployment = build_deployment(parse("chat", "ns", FULL), SETTINGS, OWNER)
    assert deployment["metadata"]["name"] == "chat-runtime"
    assert deployment["metadata"]["ownerReferences"] == [OWNER]
    spec = deployment["spec"]
    assert spec["replicas"] == 3
    assert spec["selector"] == {"matchLabels": {"serving.goodput.dev/service": "chat"}}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.local/goodput-runtime:test"
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "2"},
    }
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["securityContext"] == {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in (
        container["env"]
    )
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"model-cache": "/var/cache/goodput", "tmp": "/tmp", "dshm": "/dev/shm"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert pod["priorityClassName"] == "serving"
    assert pod["automountServiceAccountToken"] is False
    assert pod["terminationGracePeriodSeconds"] == 60
    # the kubelet falls back to the log's tail when the runtime wrote no termination message
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_grace_period_covers_the_shutdown_delay_and_the_drain():
    pod = build_deployment(parse("chat", "ns", FULL), SETTINGS, OWNER)["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    delay = float(args[args.index("--shutdown-delay") + 1])
    assert delay == SHUTDOWN_DELAY_SECONDS == 5
    parser_default = build_parser().parse_args(["--model", "m"]).shutdown_grace
    assert parser_default == RUNTIME_DRAIN_SECONDS  # the runtime's drain, as the operator assumes it
    assert pod["terminationGracePeriodSeconds"] > delay + RUNTIME_DRAIN_SECONDS


def test_pvc_source_is_mounted_read_only_and_passed_as_a_path():
    svc = parse("local", "ns", {"model": {"source": "pvc://weights/llama/8b"}, "resources": {"gpu": 0}})
    deployment = build_deployment(svc, SETTINGS, OWNER)
    pod = deployment["spec"]["template"]["spec"]
    assert {"name": "model-source", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in (
        pod["volumes"]
    )
    container = pod["containers"][0]
    assert {"name": "model-source", "mountPath": "/mnt/models", "readOnly": True} in container["volumeMounts"]
    assert container["args"][:2] == ["--model", "/mnt/models/llama/8b"]
    assert "--revision" not in container["args"]
    assert container["args"][container["args"].index("--device") + 1] == "cpu"
    assert "resources" not in container or not container["resources"].get("limits", {}).get("nvidia.com/gpu")


def test_service_exposes_http_and_metrics():
    service = build_service(parse("chat", "ns", FULL), OWNER)
    assert service["metadata"]["name"] == "chat"
    assert service["spec"]["selector"] == {"serving.goodput.dev/service": "chat"}
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [
        ("http", 80, "http"),
        ("metrics", 8000, "http"),
    ]


def test_pdb_only_for_more_than_one_replica():
    assert build_pdb(parse("chat", "ns", {**FULL, "replicas": 1}), OWNER) is None
    pdb = build_pdb(parse("chat", "ns", FULL), OWNER, api_version="policy/v1beta1")
    assert pdb["apiVersion"] == "policy/v1beta1"
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {"serving.goodput.dev/service": "chat"}}}


def test_monitors_scrape_the_metrics_endpoint():
    svc = parse("chat", "ns", FULL)
    assert build_service_monitor(svc, OWNER)["spec"]["endpoints"][0]["port"] == "metrics"
    assert build_pod_monitor(svc, OWNER)["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"


def test_the_runtime_accepts_the_command_line_the_operator_derives():
    parser = build_parser()
    for name, spec in (
        ("chat", FULL),
        ("local", {"model": {"source": "pvc://weights/m"}, "resources": {"gpu": 0}}),
        ("bare", {"model": {"source": "file:///models/tiny"}}),
    ):
        svc = parse(name, "ns", spec)
        args = parser.parse_args(runtime_args(svc))
        assert args.served_model_name == svc.model.served_name
        assert args.port == 8000 and args.tensor_parallel_size == svc.tensor_parallel
    full = parser.parse_args(runtime_args(parse("chat", "ns", FULL)))
    assert (full.slo_ttft, full.slo_tpot, full.max_num_seqs, full.enable_prefix_caching) == (0.5, 0.05, 128, True)
    assert (full.quantization, full.dtype, full.revision, full.seed) == ("int8", "bfloat16", "v1", 7)
    assert full.shutdown_delay == 5


def test_a_hub_mirror_reaches_the_pods_too():
    def env(settings):
        container = build_deployment(parse("chat", "ns", FULL), settings, OWNER)["spec"]["template"]["spec"]
        return {e["name"]: e.get("value") for e in container["containers"][0]["env"]}

    assert "HF_ENDPOINT" not in env(SETTINGS)
    mirrored = Settings(hf_endpoint="https://hf-mirror.example")
    assert env(mirrored)["HF_ENDPOINT"] == "https://hf-mirror.example"
    assert env(mirrored)["HF_HOME"] == "/var/cache/goodput/hf"
