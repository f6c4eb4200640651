"""Tenants at the gateway: API keys mapped to tenants, their limits (429 with Retry-After and OpenAI's
x-ratelimit-* headers, in each API's own shape), stored responses per tenant, per-tenant metrics, and
weighted fair turns at a saturated service. A real gateway process in front of a real runtime process;
the tenant table is a file (the Secret's form is the same YAML, read through the same code)."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
import urllib.request

import anthropic
import openai
import pytest
from gateway_helpers import Started, post_json, wait_ready

pytestmark = pytest.mark.slow

TABLE = """
tenants:
  alpha: {keys: [sk-alpha], requestsPerMinute: 3}
  beta: {keys: [sk-beta], tokensPerMinute: 120}
  gamma: {keys: [sk-gamma], concurrency: 1}
  team: {keys: [sk-team-1, sk-team-2]}
  other: {keys: [sk-other], slo: {ttftMs: 60000, tpotMs: 60000}}
"""
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
LOAD_TOKENS = 100  # each request of the fairness run: long enough that the service, capped at one in flight, queues


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tenants")
    (workdir / "tenants.yaml").write_text(TABLE)
    with Started() as started:
        replica = started.replica("r0", tiny_model_dir, workdir)
        wait_ready(replica)
        url = f"http://127.0.0.1:{replica.port}"
        gateway = started.gateway(
            workdir / "no-kubeconfig",
            workdir / "gateway.log",
            "--static-model",
            f"tiny={url}",
            "--tenants-file",
            str(workdir / "tenants.yaml"),
            "--shutdown-delay",
            "0",
        )
        yield gateway, started, workdir, url


def post(gateway, key: str | None, body=CHAT, path="/v1/chat/completions", headers: dict | None = None):
    return post_json(
        gateway.url + path, body, {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    )


def test_a_key_no_tenant_holds_gets_a_401(env):
    gateway = env[0]
    status, _, body = post(gateway, "sk-nobody")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, _ = post(gateway, None)
    assert status == 401
    assert post(gateway, "sk-team-1")[0] == 200


def test_requests_per_minute_429_with_openai_headers_in_each_apis_shape(env):
    gateway = env[0]
    for _ in range(3):
        status, headers, _ = post(gateway, "sk-alpha")
        assert status == 200
    status, headers, body = post(gateway, "sk-alpha")
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(headers["Retry-After"]) <= 60
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-alpha", max_retries=0).responses.create(
            model="tiny", input="Hi", max_output_tokens=2
        )
    with pytest.raises(anthropic.RateLimitError) as info:
        anthropic.Anthropic(base_url=gateway.url, api_key="sk-alpha", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
    assert info.value.body["error"]["type"] == "rate_limit_error"
    assert info.value.response.headers["x-ratelimit-limit-requests"] == "3"
    assert post(gateway, "sk-team-1")[0] == 200  # another tenant is untouched
    assert gateway.metric("goodput_gateway_tenant_throttled_total", tenant="alpha", limit="requests") == 3
    assert gateway.metric("goodput_gateway_tenant_requests_total", tenant="alpha", code="200") == 3


def test_tokens_per_minute_charge_streamed_tokens_as_they_flow(env):
    gateway = env[0]
    body = {**CHAT, "max_tokens": 150, "ignore_eos": True, "stream": True, "temperature": 0}
    body["stream_options"] = {"include_usage": True}  # the charge settles to the usage at the end
    request = urllib.request.Request(
        gateway.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer sk-beta"},
    )
    charged = lambda: gateway.metric("goodput_gateway_tenant_tokens_total", tenant="beta")  # noqa: E731
    with urllib.request.urlopen(request, timeout=60) as stream:
        # the stream's tokens are charged as they flow: once they pass the limit, while the stream still
        # runs, the next request is refused (a chunk is charged as one token; a busy machine may pack
        # several into one, so the charge is read rather than the chunks counted)
        while charged() < 120:
            line = stream.readline()
            assert line, f"the stream ended with {charged()} tokens charged"
        status, headers, refused = post(gateway, "sk-beta")
        assert status == 429 and refused["error"]["type"] == "tokens", refused
        assert headers["x-ratelimit-limit-tokens"] == "120" and headers["x-ratelimit-remaining-tokens"] == "0"
        stream.read()
    assert charged() >= 120
    assert gateway.metric("goodput_gateway_tenant_throttled_total", tenant="beta", limit="tokens") == 1


def test_concurrent_requests_limit(env):
    gateway = env[0]
    body = {**CHAT, "max_tokens": 120, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(
        gateway.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer sk-gamma"},
    )
    with urllib.request.urlopen(request, timeout=60) as stream:
        stream.readline()
        status, headers, refused = post(gateway, "sk-gamma")
        assert status == 429 and "concurrent" in refused["error"]["message"] and headers["Retry-After"] == "1"
        stream.read()
    assert post(gateway, "sk-gamma")[0] == 200  # the stream's end freed its place


def test_stored_responses_belong_to_the_tenant_not_the_key(env):
    gateway = env[0]

    def client(key):
        return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)

    stored = client("sk-team-1").responses.create(model="tiny", input="Hi", max_output_tokens=2)
    assert client("sk-team-2").responses.retrieve(stored.id).id == stored.id  # the same tenant's other key
    with pytest.raises(openai.NotFoundError):
        client("sk-other").responses.retrieve(stored.id)


def test_per_request_slos_judge_goodput_before_the_tenants_defaults(env):
    gateway = env[0]

    def judged(result: str) -> float:
        return gateway.metric("goodput_gateway_slo_requests_total", service="tiny", result=result)

    def good() -> float:
        return gateway.metric("goodput_gateway_tenant_good_requests_total", tenant="other")

    stream = {**CHAT, "max_tokens": 8, "stream": True}
    before = judged("good"), judged("missed"), good()
    assert post_raw(gateway, "sk-other", stream) == 200  # the tenant's default targets: a minute each
    assert (judged("good"), judged("missed"), good()) == (before[0] + 1, before[1], before[2] + 1)
    # the request's own target wins over its tenant's: a microsecond TPOT is missed (admitted: nothing else
    # runs, so no running decode is slowed past it)
    assert post_raw(gateway, "sk-other", stream, {"x-goodput-slo-tpot-ms": "0.001"}) == 200
    assert (judged("missed"), good()) == (before[1] + 1, before[2] + 1)
    # llm-d's header is read too, for a tenant with no targets of its own (and a service with none)
    assert post_raw(gateway, "sk-team-1", stream, {"x-llm-d-slo-tpot-ms": "0.001"}) == 200
    assert judged("missed") == before[1] + 2
    # a microsecond TTFT reaches the runtime, whose admission refuses it at once (not judged: never served)
    status, headers, body = post(gateway, "sk-other", stream, headers={"x-goodput-slo-ttft-ms": "0.001"})
    assert status == 429 and body["error"]["code"] == "slo_unattainable" and int(headers["Retry-After"]) >= 1
    assert judged("missed") == before[1] + 2
    unjudged = judged("good") + judged("missed")
    assert post_raw(gateway, "sk-team-1", stream) == 200  # no target anywhere: not judged
    assert judged("good") + judged("missed") == unjudged
    status, _, body = post(gateway, "sk-team-1", CHAT, headers={"x-goodput-slo-tpot-ms": "fast"})
    assert status == 400 and body["error"]["param"] == "x-goodput-slo-tpot-ms"


def post_raw(gateway, key: str, body: dict, headers: dict | None = None) -> int:
    """A streamed request read to its end; its status."""
    request = urllib.request.Request(
        gateway.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        answer.read()
        return answer.status


def run_load(url: str, key: str, rate: float, seconds: float, latencies: list[float], errors: list[int]) -> None:
    """Open-loop requests at `rate` per second for `seconds`, each on its own thread."""
    body = {**CHAT, "max_tokens": LOAD_TOKENS, "ignore_eos": True}
    threads = []

    def one() -> None:
        started = time.monotonic()
        status, _, _ = post_json(url + "/v1/chat/completions", body, {"Authorization": f"Bearer {key}"}, timeout=120)
        if status == 200:
            latencies.append(time.monotonic() - started)
        else:
            errors.append(status)

    end = time.monotonic() + seconds
    next_at = time.monotonic()
    while next_at < end:
        time.sleep(max(0.0, next_at - time.monotonic()))
        thread = threading.Thread(target=one)
        thread.start()
        threads.append(thread)
        next_at += 1 / rate
    for thread in threads:
        thread.join(150)


def capacity(url: str, key: str, seconds: float = 4.0) -> float:
    """Requests per second the capped service completes, from two closed-loop clients (one waits its turn)."""
    done: list[float] = []
    stop = time.monotonic() + seconds

    def client() -> None:
        body = {**CHAT, "max_tokens": LOAD_TOKENS, "ignore_eos": True}
        while time.monotonic() < stop:
            post_json(url + "/v1/chat/completions", body, {"Authorization": f"Bearer {key}"}, timeout=120)
            done.append(time.monotonic())

    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    return len(done) / (max(done) - started)


def test_a_flooding_tenant_does_not_starve_a_light_one(env, tmp_path):
    """Two tenants on one saturated service, one sending 10x the other's rate: the light tenant's goodput
    (requests within its SLO) stays at least 0.9x what it gets alone. The rates follow the service's
    measured capacity C (this machine's speed varies with what else runs on it): the light tenant sends
    C/5, the heavy one 2C, so the service is saturated and the light tenant asks less than its half."""
    _, started, workdir, replica_url = env
    (tmp_path / "fair.yaml").write_text("tenants:\n  light: {keys: [sk-light]}\n  heavy: {keys: [sk-heavy]}\n")
    gateway = started.gateway(
        workdir / "no-kubeconfig",
        workdir / "fair-gateway.log",
        "--static-model",
        f"tiny={replica_url}",
        "--tenants-file",
        str(tmp_path / "fair.yaml"),
        "--max-in-flight-per-replica",
        "1",
        "--queue-seconds",
        "300",
        "--shutdown-delay",
        "0",
    )
    rate = capacity(gateway.url, "sk-light") / 5
    seconds = 12 / rate  # twelve light requests a phase: one may miss (noise) and still pass
    alone: list[float] = []
    errors: list[int] = []
    run_load(gateway.url, "sk-light", rate, seconds, alone, errors)
    slo = 4 * statistics.median(alone)  # room for a turn behind the running request
    good_alone = sum(latency <= slo for latency in alone)

    shared: list[float] = []
    heavy: list[float] = []
    flood = threading.Thread(target=run_load, args=(gateway.url, "sk-heavy", 10 * rate, seconds + 2, heavy, errors))
    flood.start()
    time.sleep(min(2.0, 2 / rate))  # the heavy tenant's queue builds first
    run_load(gateway.url, "sk-light", rate, seconds, shared, errors)
    flood.join(400)
    good_shared = sum(latency <= slo for latency in shared)
    queued = gateway.metric("goodput_gateway_tenant_queue_seconds_count", tenant="heavy")
    print(
        f"capacity {5 * rate:.2f} req/s; light alone {good_alone}/{len(alone)} good (median "
        f"{statistics.median(alone):.3f} s), shared {good_shared}/{len(shared)} (median "
        f"{statistics.median(shared):.3f} s); heavy {len(heavy)} done (median {statistics.median(heavy):.3f} s)"
    )
    assert not errors
    assert queued > 0 and statistics.median(heavy) > slo  # the service was saturated: the heavy tenant queued
    assert good_shared >= 0.9 * good_alone


def test_tenants_from_a_secret_under_the_gateways_own_account(cluster, tmp_path):
    """The table in a Secret, read with the gateway's RBAC (no new rule), and read again after a change."""
    from harness import service_account_kubeconfig, wait_for

    namespace = f"gwtenants-{int(time.time()) % 100000}"
    kubeconfig = service_account_kubeconfig(
        cluster, ("namespace.yaml", "gateway-rbac.yaml"), "goodput-gateway", tmp_path / "gateway.kubeconfig"
    )
    with Started() as started:
        started.namespaces(cluster, namespace)
        table = "tenants:\n  alpha: {keys: [sk-alpha]}\n"
        cluster.core.create_namespaced_secret(
            namespace, {"metadata": {"name": "tenants"}, "stringData": {"tenants.yaml": table}}
        )
        gateway = started.gateway(
            kubeconfig, tmp_path / "gateway.log", "--tenants-secret", f"{namespace}/tenants", "--api-key-ttl", "1"
        )
        # a tenant's key gets as far as the model (none is served here); any other key stops at the door
        assert post(gateway, "sk-alpha", {**CHAT, "model": "none"})[0] == 404
        assert post(gateway, "sk-beta", {**CHAT, "model": "none"})[0] == 401
        cluster.core.patch_namespaced_secret(
            "tenants", namespace, {"stringData": {"tenants.yaml": table + "  beta: {keys: [sk-beta]}\n"}}
        )
        wait_for(lambda: post(gateway, "sk-beta", {**CHAT, "model": "none"})[0] == 404, 20, "the new tenant")
        assert "sk-alpha" not in gateway.log() and "sk-beta" not in gateway.log()


def test_fair_turns_order_by_class_then_weighted_share():
    """The gate's order alone (no processes): one place, freed one request at a time."""
    from goodput_gateway.tenants import FairGate, NoTurn, Tenant

    heavy, light = Tenant("heavy"), Tenant("light")
    double = Tenant("double", weight=2)
    urgent, cheap = Tenant("urgent", priority="critical"), Tenant("cheap", priority="sheddable")

    async def order(arrivals: list[Tenant]) -> list[str]:
        gate = FairGate()
        served: list[tuple[int, str]] = []
        releases: dict[int, asyncio.Event] = {}

        async def one(i: int, tenant: Tenant) -> None:
            async with gate.turn(tenant, 1, 10):
                releases[i] = asyncio.Event()
                served.append((i, tenant.name))
                await releases[i].wait()

        tasks = []
        for i, tenant in enumerate([heavy, *arrivals]):  # the first takes the place, the rest queue
            tasks.append(asyncio.create_task(one(i, tenant)))
            await asyncio.sleep(0)
        for k in range(len(tasks)):
            for _ in range(100):
                if len(served) > k:
                    break
                await asyncio.sleep(0)
            releases[served[k][0]].set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return [name for _, name in served[1:]]

    # the flood came first, yet the light tenant's two requests are served within the first four
    served = asyncio.run(order([heavy] * 6 + [light] * 2))
    assert [i for i, name in enumerate(served) if name == "light"] in ([0, 2], [1, 3], [0, 3], [1, 2])
    # a weight of 2 gets two turns to one
    assert asyncio.run(order([heavy] * 4 + [double] * 4))[:6].count("double") == 4
    # classes first: critical before standard before sheddable, whatever the arrival order
    assert asyncio.run(order([cheap, heavy, urgent])) == ["urgent", "heavy", "cheap"]

    async def timeout() -> None:
        gate = FairGate()
        async with gate.turn(heavy, 1, 10):
            with pytest.raises(NoTurn):
                async with gate.turn(light, 1, 0.05):
                    pass
        assert gate.in_flight == 0 and not gate.waiting

    asyncio.run(timeout())
