"""The gateway as a process: services discovered from the API server, requests to real runtimes.

Three `python -m goodput_runtime` processes on the tiny model serve every service here;
each namespace's InferenceService (all with servedName `tiny`, so clients name them
`namespace/tiny`) is published with a different set of them as its ready endpoints.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from autoscaling_helpers import delete_endpoint, free_port
from gateway_helpers import GatewayProcess, Started, metric, post_json, publish, tiny_spec, wait_ready
from harness import wait_for
from prometheus_process import PROMETHEUS, Prometheus, dashboard_queries

NAMESPACES = ("prefix", "least", "solo", "dead", "zero")
HOLD_SECONDS, MAX_HELD = 8, 2


class Env:
    def __init__(self, gateway: GatewayProcess, replicas: list, ns: dict[str, str]) -> None:
        self.gateway, self.replicas, self.ns = gateway, replicas, ns
        self.prometheus: Prometheus | None = None
        self.started = time.time()

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p.port}" for p in self.replicas]

    def model(self, which: str) -> str:
        return f"{self.ns[which]}/tiny"

    def served(self) -> list[float]:
        return [metric(u, "goodput_requests_total") for u in self.urls]

    def post(self, path: str, body: dict, timeout: float = 60) -> tuple[int, dict, dict]:
        return post_json(self.gateway.url + path, body, timeout=timeout)


@pytest.fixture(scope="module")
def env(cluster, tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gateway")
    suffix = f"{int(time.time()) % 100000}"
    ns = {which: f"gw-{which}-{suffix}" for which in NAMESPACES}
    with Started() as started:
        started.namespaces(cluster, *ns.values())
        replicas = [started.replica(f"r{i}", tiny_model_dir, workdir) for i in range(3)]
        cluster.create_service(ns["prefix"], "tiny", tiny_spec(replicas=3))
        cluster.create_service(ns["least"], "tiny", tiny_spec(replicas=3, routing={"policy": "least-load"}))
        cluster.create_service(ns["solo"], "tiny", tiny_spec())
        cluster.create_service(ns["dead"], "tiny", tiny_spec(replicas=2, routing={"policy": "random"}))
        cluster.create_service(
            ns["zero"],
            "tiny",
            tiny_spec(autoscaling={"mode": "goodput", "minReplicas": 0, "maxReplicas": 1, "idlePeriod": "1m"}),
        )
        wait_ready(*replicas)
        for pod in replicas:
            publish(cluster, ns["prefix"], "tiny", pod.name, pod.port)
            publish(cluster, ns["least"], "tiny", pod.name, pod.port)
        publish(cluster, ns["solo"], "tiny", replicas[1].name, replicas[1].port)
        publish(cluster, ns["dead"], "tiny", replicas[0].name, replicas[0].port)
        publish(cluster, ns["dead"], "tiny", "gone", free_port())  # listed ready, nothing listening
        gateway = started.gateway(
            cluster.kubeconfig,
            workdir / "gateway.log",
            "--hold-seconds",
            str(HOLD_SECONDS),
            "--max-held-requests",
            str(MAX_HELD),
        )
        e = Env(gateway, replicas, ns)
        if PROMETHEUS:  # scrapes the gateway throughout, for the dashboard's gateway panels
            e.prometheus = started.stops(Prometheus(workdir, ns["prefix"], None, (int(gateway.url.rsplit(":", 1)[1]),)))
        wait_for(
            lambda: all(
                m["ready_replicas"] == want
                for m in gateway.models()
                for which, want in (("prefix", 3), ("dead", 2))
                if m["id"] == e.model(which)
            ),
            30,
            "the gateway to see the endpoints",
        )
        yield e


def test_models_lists_every_service_including_one_at_zero(env):
    models = {m["id"]: m for m in env.gateway.models()}
    assert models[env.model("prefix")]["ready_replicas"] == 3
    zero = models[env.model("zero")]
    assert (zero["replicas"], zero["ready_replicas"]) == (0, 0)
    assert zero["object"] == "model" and zero["root"] == "tiny"


def test_the_gateways_metrics_hold_no_operator_series(env):
    # the gateway talks to the API server through the operator's client, which counts no writes for it
    text = urllib.request.urlopen(env.gateway.url + "/metrics", timeout=5).read().decode()
    assert "goodput_gateway_" in text and "goodput_operator_" not in text


def test_errors_keep_openais_shape(env):
    client = openai.OpenAI(base_url=env.gateway.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert err.value.code == "model_not_found" and err.value.body["type"] == "invalid_request_error"
    status, _, body = env.post("/v1/completions", {"model": "tiny", "prompt": "hi"})
    assert (
        status == 400 and body["error"]["code"] == "ambiguous_model" and env.model("prefix") in body["error"]["message"]
    )
    status, _, body = env.post("/v1/completions", {"prompt": "hi"})
    assert (status, body["error"]["param"]) == (400, "model")
    request = urllib.request.Request(env.gateway.url + "/v1/completions", data=b"{not json")
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(request, timeout=10)
    assert http_err.value.code == 400 and "error" in json.loads(http_err.value.read())
    # the runtime's own 400 passes through unchanged
    status, _, body = env.post("/v1/completions", {"model": env.model("prefix"), "prompt": "hi", "max_tokens": -1})
    assert status == 400 and body["error"]["param"] == "max_tokens"


def test_openai_sdk_streams_and_every_runtime_endpoint_passes_through(env):
    client = openai.OpenAI(base_url=env.gateway.url + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model=env.model("prefix"),
        max_tokens=8,
        stream=True,
        messages=[{"role": "user", "content": "Say something."}],
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 8 and text and chunks[0].model == "tiny"
    completion = client.completions.create(model=env.model("least"), prompt="Once upon", max_tokens=4)
    assert completion.usage.completion_tokens == 4
    embedding = client.embeddings.create(model=env.model("prefix"), input=["one", "two"])
    assert len(embedding.data) == 2 and len(embedding.data[0].embedding) > 0
    tokens = httpx.post(env.gateway.url + "/tokenize", json={"model": env.model("prefix"), "prompt": "hello"}).json()
    text = httpx.post(
        env.gateway.url + "/detokenize", json={"model": env.model("prefix"), "tokens": tokens["tokens"]}
    ).json()
    assert tokens["count"] > 0 and text["prompt"].strip() == "hello"


def test_requests_sharing_a_prefix_go_to_the_same_replica(env):
    prefixes = [f"Document {i}: " + f"section {i} of the handbook, paragraph after paragraph. " * 6 for i in range(8)]
    homes: dict[int, set[int]] = {}

    # a prefix's own replica, by the ring (affinity) or, once the replicas' cache events show who holds
    # it, by what is held (held_device)
    def at_home() -> float:
        return sum(
            env.gateway.metric("goodput_gateway_routing_decisions_total", namespace=env.ns["prefix"], decision=d)
            for d in ("affinity", "held_device", "held_offload")
        )

    before_home = at_home()
    for turn in range(3):
        for i, prefix in enumerate(prefixes):
            before = env.served()
            status, _, _ = env.post(
                "/v1/completions",
                {"model": env.model("prefix"), "max_tokens": 2, "prompt": prefix + f" Question {turn}?"},
            )
            assert status == 200
            after = env.served()
            homes.setdefault(i, set()).update(r for r in range(3) if after[r] > before[r])
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len(set.union(*homes.values())) >= 2, "eight prefixes must not all hash to one replica"
    assert at_home() - before_home == 24


def _concurrently(env: Env, model: str, prompts: list[str], max_tokens: int) -> list[float]:
    before = env.served()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(
            pool.map(
                lambda p: env.post(
                    "/v1/completions", {"model": model, "prompt": p, "max_tokens": max_tokens, "ignore_eos": True}
                ),
                prompts,
            )
        )
    assert all(status == 200 for status, _, _ in results), results
    return [a - b for a, b in zip(env.served(), before, strict=True)]


def test_a_hot_prefix_overflows_to_other_replicas_and_least_load_spreads(env):
    prefix = "The same system prompt for everyone. " * 10
    before = env.gateway.metric(
        "goodput_gateway_routing_decisions_total", namespace=env.ns["prefix"], decision="overflow"
    )
    spread = _concurrently(env, env.model("prefix"), [prefix + f"q{i}" for i in range(6)], 150)
    assert sum(1 for n in spread if n) >= 2, spread
    assert (
        env.gateway.metric("goodput_gateway_routing_decisions_total", namespace=env.ns["prefix"], decision="overflow")
        > before
    )
    spread = _concurrently(env, env.model("least"), [prefix + f"q{i}" for i in range(3)], 150)
    assert spread == [1, 1, 1]


def test_a_dead_replica_is_retried_elsewhere(env):
    for i in range(12):
        status, _, body = env.post(
            "/v1/completions", {"model": env.model("dead"), "prompt": f"try {i}", "max_tokens": 2}
        )
        assert status == 200, body
    assert (
        env.gateway.metric("goodput_gateway_routing_decisions_total", namespace=env.ns["dead"], decision="retry") >= 1
    )


def test_a_client_that_disconnects_aborts_the_runtimes_request(env):
    solo = env.urls[1]
    aborted = metric(solo, "goodput_requests_total", outcome="abort")
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST",
            env.gateway.url + "/v1/completions",
            json={
                "model": env.model("solo"),
                "prompt": "Count:",
                "max_tokens": 480,
                "ignore_eos": True,
                "stream": True,
            },
        ) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert metric(solo, "goodput_requests_running") == 1
    wait_for(lambda: metric(solo, "goodput_requests_running") == 0, 10, "the runtime to free the request")
    assert metric(solo, "goodput_requests_total", outcome="abort") == aborted + 1


def test_a_request_for_a_service_at_zero_is_held_until_a_replica_is_ready(env, cluster):
    answers: list[tuple[int, dict, dict]] = []
    worker = threading.Thread(
        target=lambda: answers.append(
            env.post("/v1/completions", {"model": env.model("zero"), "prompt": "wake up", "max_tokens": 2})
        )
    )
    worker.start()
    wait_for(
        lambda: env.gateway.metric("goodput_gateway_requests_waiting", namespace=env.ns["zero"]) == 1,
        5,
        "the request to be held",
    )
    time.sleep(1)
    assert not answers
    pod = env.replicas[2]
    publish(cluster, env.ns["zero"], "tiny", pod.name, pod.port)
    worker.join(HOLD_SECONDS)
    assert answers and answers[0][0] == 200, answers
    assert env.gateway.metric("goodput_gateway_requests_waiting", namespace=env.ns["zero"]) == 0


def test_past_the_hold_bound_and_the_wait_limit_clients_get_429_and_503_with_retry_after(env, cluster):
    delete_endpoint(cluster, env.ns["zero"], "tiny", env.replicas[2].name)
    wait_for(
        lambda: next(m for m in env.gateway.models() if m["id"] == env.model("zero"))["ready_replicas"] == 0,
        10,
        "the replica to go",
    )
    body = {"model": env.model("zero"), "prompt": "anyone?", "max_tokens": 2}
    series = "goodput_gateway_requests_refused_total"
    before = {
        reason: env.gateway.metric(series, namespace=env.ns["zero"], reason=reason)
        for reason in ("queue_full", "hold_timeout")
    }
    with ThreadPoolExecutor(MAX_HELD + 1) as pool:
        held = [pool.submit(env.post, "/v1/completions", body) for _ in range(MAX_HELD)]
        wait_for(
            lambda: env.gateway.metric("goodput_gateway_requests_waiting", namespace=env.ns["zero"]) == MAX_HELD,
            5,
            "the queue to fill",
        )
        status, headers, refused = env.post("/v1/completions", body)
        assert status == 429 and int(headers["Retry-After"]) >= 1 and refused["error"]["type"] == "rate_limit_error"
        started = time.monotonic()
        outcomes = [f.result() for f in held]
    assert time.monotonic() - started >= HOLD_SECONDS - 2
    assert all(s == 503 and int(h["Retry-After"]) >= 1 for s, h, _ in outcomes), outcomes
    # every request turned away is counted, by why: demand the autoscaler adds to what the pods saw
    assert env.gateway.metric(series, namespace=env.ns["zero"], reason="queue_full") == before["queue_full"] + 1
    assert (
        env.gateway.metric(series, namespace=env.ns["zero"], reason="hold_timeout") == before["hold_timeout"] + MAX_HELD
    )


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus missing (make prometheus)")
def test_every_gateway_panel_of_the_dashboard_returns_data(env):
    values = {"$namespace": "gw-.*", "$service": "tiny", "$__rate_interval": "10s"}
    # the hand-off row's series exist only for a disaggregated service, which this environment does not
    # run; test_gateway_two_phase_live.py checks those series on real prefill and decode runtimes. Peer
    # pulls only between runtimes of --kv-transfer-role both: test_peer_pull_dashboard_panels.py
    queries = dashboard_queries(
        values,
        lambda expr: (
            "goodput_gateway_" in expr and not any(s in expr for s in ("disaggregation", "handoff", "peer_pull"))
        ),
    )
    assert len(queries) >= 4
    empty = env.prometheus.panels_without_data(queries, env.started)
    assert not empty, f"no data for: {empty}"


def test_a_stopping_gateway_finishes_its_streams_and_sends_clients_elsewhere(env, cluster, tmp_path):
    with Started() as started:
        second = started.gateway(cluster.kubeconfig, tmp_path / "second.log", "--shutdown-delay", "2")
        body = {
            "model": env.model("solo"),
            "prompt": "Count:",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", second.url + "/v1/completions", json=body) as response,
        ):
            lines = response.iter_lines()
            next(lines)
            second.process.terminate()
            wait_for(lambda: httpx.get(second.url + "/health").status_code == 503, 2, "health to turn 503")
            during = httpx.post(
                second.url + "/v1/completions", json={"model": env.model("solo"), "prompt": "hi", "max_tokens": 2}
            )
            assert during.status_code == 200 and during.headers["connection"] == "close"
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 200  # the whole stream
        assert second.process.wait(20) == 0
