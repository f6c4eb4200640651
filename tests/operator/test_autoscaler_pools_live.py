"""A disaggregated service's two pools in the goodput control loop, against a real API server and the
operator process: status per pool, and the prefill count written through the `<name>-prefill`
Deployment's scale subresource under the autoscaler's field manager, with an Event naming the pool.

No runtime pods here (no kubelet): the pools have no ready endpoints, so the loop holds on missing
metrics except where a count is out of its pool's bounds. The law per pool is tests/unit/test_autoscaler_pools.py.
"""

import pytest
from harness import wait_for
from live_pods import autoscaling_operator

QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
SPEC = {
    "model": {"source": "hf://acme/pools-7b", "servedName": "chat", "maxModelLen": 8192},
    "resources": {"gpu": 1, "gpuMemory": "80Gi"},
    "slo": {"ttft": "2s", "tpot": "100ms", "attainment": 0.9},
    "autoscaling": {"mode": "goodput", "minReplicas": 1, "maxReplicas": 3},
    "disaggregation": {"prefill": {"minReplicas": 1, "maxReplicas": 3}, "decode": {"minReplicas": 1, "maxReplicas": 3}},
}


@pytest.fixture(autouse=True)
def configs(hub):
    hub.configs["acme/pools-7b"] = QWEN25_7B


@pytest.fixture(scope="module")
def operator(cluster, hub, tmp_path_factory):
    """The operator with a 1 s control period and a 3 s window."""
    process, _ = autoscaling_operator(cluster, hub, tmp_path_factory.mktemp("operator-pools"), 1, 3)
    yield process
    process.stop()


def _pools(cluster, namespace, name):
    return ((cluster.get_service(namespace, name).get("status") or {}).get("autoscaler") or {}).get("pools") or {}


def _prefill(cluster, namespace, name):
    return cluster.get_or_none(cluster.apps.read_namespaced_deployment, f"{name}-prefill", namespace)


def test_each_pool_reports_its_own_decision(cluster, operator, namespace):
    cluster.create_service(namespace, "pools", SPEC)
    pools = wait_for(lambda: (p := _pools(cluster, namespace, "pools")) and len(p) == 2 and p, 60, "both pools")
    for pool in ("prefill", "decode"):
        assert pools[pool]["desiredReplicas"] == 1
        assert pools[pool]["term"] == "metrics_missing"  # no ready pod: never read as zero load
    message = cluster.get_service(namespace, "pools")["status"]["autoscaler"]["message"]
    assert "prefill pool" in message and "decode pool" in message


def test_the_prefill_count_is_written_through_the_deployments_scale(cluster, operator, namespace):
    cluster.create_service(namespace, "wide", SPEC)
    wait_for(lambda: _prefill(cluster, namespace, "wide"), 60, "Deployment wide-prefill")
    wait_for(lambda: _pools(cluster, namespace, "wide"), 60, "the autoscaler's first pass")
    # someone scales the prefill pool past its maxReplicas: the autoscaler brings it back within bounds
    cluster.apps.patch_namespaced_deployment_scale("wide-prefill", namespace, {"spec": {"replicas": 6}})
    wait_for(lambda: _prefill(cluster, namespace, "wide").spec.replicas == 3, 60, "the prefill pool back at 3")
    managers = {f.manager for f in _prefill(cluster, namespace, "wide").metadata.managed_fields or ()}
    assert "goodput-autoscaler" in managers
    event = wait_for(
        lambda: next(
            (e for e in cluster.events(namespace, "wide") if "prefill pool: 6 → 3 replicas (bounds)" in e.message),
            None,
        ),
        60,
        "an Event naming the pool and the term",
    )
    assert event.reason == "ScaledDown"
    assert _pools(cluster, namespace, "wide")["prefill"]["term"] == "bounds"
    # the decode pool was not touched: the InferenceService's own count stands
    assert "replicas" not in cluster.get_service(namespace, "wide")["spec"]


@pytest.mark.parametrize(
    "pool, other, slo, flags",
    [
        # one request at a time and a 10 ms TTFT target: every queued prompt misses TTFT
        ("prefill", "decode", {"ttft": "10ms", "tpot": "1s"}, ("--slo-ttft", "0.01", "--slo-tpot", "1")),
        # a 1 ms TPOT target: every request misses TPOT, while TTFT has a minute
        ("decode", "prefill", {"ttft": "60s", "tpot": "1ms"}, ("--slo-ttft", "60", "--slo-tpot", "0.001")),
    ],
)
def test_a_miss_on_a_real_pods_own_target_wakes_its_pools_guard_only(
    cluster, operator, namespace, tiny_model_dir, tmp_path, pool, other, slo, flags
):
    """A real runtime process stands in for one pool's pod (published in that pool's Service's
    EndpointSlice, as the EndpointSlice controller would: `<name>-prefill` for prefill, `<name>` for
    decode), serving one request at a time so that requests queue. A miss of that pool's own target wakes
    its guard: the prefill pool grows through its Deployment's scale subresource, the decode pool through
    the InferenceService's; the other pool, with no ready pod, holds."""
    import threading
    import urllib.request

    from autoscaling_helpers import host_address, put_endpoint, scale_replicas
    from live_pods import Pod

    name = f"miss-{pool}"
    cluster.create_service(namespace, name, {**SPEC, "slo": {**slo, "attainment": 0.9}})
    wait_for(lambda: _prefill(cluster, namespace, name), 60, f"Deployment {name}-prefill")
    pod = Pod("p0", tiny_model_dir, tmp_path / "p0.log", ("--max-num-seqs", "1", "--admission", "off", *flags))
    stop = threading.Event()
    try:
        wait_for(pod.poll_ready, 120, "the runtime ready")
        service = f"{name}-prefill" if pool == "prefill" else name
        put_endpoint(cluster, namespace, service, "p0", host_address(), pod.port, ready=True)

        def send() -> None:
            body = b'{"model": "tiny", "prompt": "' + b"tell me a long story " * 20 + b'", "max_tokens": 4}'
            while not stop.is_set():
                request = urllib.request.Request(
                    f"http://127.0.0.1:{pod.port}/v1/completions", body, {"Content-Type": "application/json"}
                )
                try:
                    urllib.request.urlopen(request, timeout=60).read()
                except OSError:
                    stop.wait(0.2)

        for _ in range(6):
            threading.Thread(target=send, daemon=True).start()
        event = wait_for(
            lambda: next((e for e in cluster.events(namespace, name) if f"{pool} pool: 1 → 2" in e.message), None),
            120,
            f"the {pool} guard's scale-up",
        )
        assert "(guard)" in event.message and event.reason == "ScaledUp"
        if pool == "prefill":
            assert _prefill(cluster, namespace, name).spec.replicas >= 2
        else:
            assert scale_replicas(cluster, namespace, name) >= 2
        # a pass with no request finished in its window leaves attainment out: wait for one that has it
        pools = wait_for(
            lambda: (p := _pools(cluster, namespace, name)) and "attainment" in p.get(pool, {}) and p,
            60,
            f"the {pool} pool's attainment in the status",
        )
        assert pools[pool]["attainment"] < 0.9
        assert pools[other]["desiredReplicas"] == 1  # the miss is not the other pool's to answer
        assert not any(f"{other} pool" in e.message for e in cluster.events(namespace, name))
    finally:
        stop.set()
        pod.stop()
