"""Per-request SLOs in the runtime's admission: real runtime processes (two seats each) with a queue of long
requests, and probes over real HTTP, straight to the runtimes and through a real gateway process whose tenant
table gives one tenant a tight default. A request's own TTFT target drives its admission: a tight one is
refused at once (429, Retry-After) by a runtime whose own target (`--slo-ttft 60`) admits the same request,
a loose one admitted by a runtime whose target (`--slo-ttft 0.005`) refuses it; the runtime counts both
decisions."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from gateway_helpers import Started, metric, post_json, wait_ready
from helpers import wait_for

pytestmark = pytest.mark.slow

TABLE = """
tenants:
  tight: {keys: [sk-tight], slo: {ttftMs: 5}}
  plain: {keys: [sk-plain]}
"""
LOAD = {"model": "tiny", "prompt": "a b c d e f g h", "max_tokens": 200, "ignore_eos": True}
PROBE = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
TIGHT, LOOSE = {"x-goodput-slo-ttft-ms": "5"}, {"x-goodput-slo-ttft-ms": "600000"}
FLAGS = ("--admission-margin", "0", "--max-num-seqs", "2", "--max-model-len", "256")
QUEUE = 8  # loose long requests: two running, six waiting, about 800 decode steps ahead of a probe


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("request-slo")
    (workdir / "tenants.yaml").write_text(TABLE)
    with Started() as started:
        lenient = started.replica("lenient", tiny_model_dir, workdir, "--slo-ttft", "60", *FLAGS)
        strict = started.replica("strict", tiny_model_dir, workdir, "--slo-ttft", "0.005", *FLAGS)
        wait_ready(lenient, strict)
        urls = [f"http://127.0.0.1:{p.port}" for p in (lenient, strict)]
        gateway = started.gateway(
            workdir / "no-kubeconfig",
            workdir / "gateway.log",
            "--static-model",
            f"tiny={urls[0]}",
            "--tenants-file",
            str(workdir / "tenants.yaml"),
            "--shutdown-delay",
            "0",
        )
        for url in urls:  # the engine measures its prefill and decode rates and the typical output length
            for _ in range(3):
                assert post_json(url + "/v1/completions", LOAD, LOOSE)[0] == 200
        yield gateway, urls


def status_of(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str], dict]:
    """A streamed probe's status, headers and (refused) error body. A refused probe's status comes at once;
    an admitted one's with its first token, after the queue ahead of it, and it is let go then. So a test
    sends the probes it expects refused first, while the queue is whole."""
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({**PROBE, "stream": True}).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, dict(answer.headers), {}
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def under_load(url: str, probes: list[tuple[str, dict[str, str]]]) -> list[tuple[int, dict[str, str], dict]]:
    """The probes' answers while `url`'s runtime has both seats taken and six requests waiting (each of the
    queue's 200 tokens: the queue ahead of the last probe still takes hundreds of decode steps, however slow
    the probes through the gateway are on a loaded machine)."""

    async def run() -> list[tuple[int, dict[str, str], dict]]:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(QUEUE) as pool:  # asyncio's default pool has too few threads on a small machine
            tasks = [loop.run_in_executor(pool, post_json, url + "/v1/completions", LOAD, LOOSE) for _ in range(QUEUE)]
            await asyncio.to_thread(
                wait_for, lambda: metric(url, "goodput_requests_waiting") >= QUEUE - 2, 30, "a queue of six", every=0.01
            )
            answers = [await asyncio.to_thread(status_of, base, headers) for base, headers in probes]
            assert [t[0] for t in await asyncio.gather(*tasks)] == [200] * QUEUE
        return answers

    return asyncio.run(run())


def own_slo(url: str) -> tuple[float, float]:
    return tuple(metric(url, "goodput_requests_own_slo_total", decision=d) for d in ("admitted", "refused"))


def test_a_tight_target_is_refused_where_the_servers_admits(env):
    _, (lenient, _) = env
    before, rejected = own_slo(lenient), metric(lenient, "goodput_requests_rejected_total", reason="ttft_slo")
    tight, default = under_load(lenient, [(lenient, TIGHT), (lenient, {})])
    assert default[0] == 200, default
    status, headers, body = tight
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "slo_unattainable" and "exceeds the 0.005s target" in body["error"]["message"]
    # the queue's (loose) requests and the tight one
    assert own_slo(lenient) == (before[0] + QUEUE, before[1] + 1)
    assert metric(lenient, "goodput_requests_rejected_total", reason="ttft_slo") == rejected + 1


def test_a_loose_target_is_admitted_where_the_servers_refuses(env):
    _, (_, strict) = env
    before = own_slo(strict)
    default, loose = under_load(strict, [(strict, {}), (strict, LOOSE)])
    assert default[0] == 429 and "exceeds the 0.005s target" in default[2]["error"]["message"]
    assert loose[0] == 200 and float(loose[1]["x-goodput-predicted-ttft"]) > 0.005
    assert own_slo(strict) == (before[0] + QUEUE + 1, before[1])


def test_a_tenants_default_target_reaches_the_runtime_through_the_gateway(env):
    gateway, (lenient, _) = env
    tight, plain = {"Authorization": "Bearer sk-tight"}, {"Authorization": "Bearer sk-plain"}
    answers = under_load(lenient, [(gateway.url, tight), (gateway.url, plain), (gateway.url, {**tight, **LOOSE})])
    assert [a[0] for a in answers] == [429, 200, 200], answers
    _, headers, body = answers[0]
    assert int(headers["Retry-After"]) >= 1 and body["error"]["code"] == "slo_unattainable"


@pytest.mark.parametrize("header", ["x-goodput-slo-ttft-ms", "x-goodput-slo-tpot-ms", "x-llm-d-slo-ttft-ms"])
@pytest.mark.parametrize("value", ["fast", "0", "-3", "nan", "inf"])
def test_a_target_that_is_not_a_positive_number_is_a_400_naming_the_header(env, header, value):
    gateway, (url, _) = env
    for base, auth in ((url, {}), (gateway.url, {"Authorization": "Bearer sk-plain"})):
        status, _, body = post_json(base + "/v1/completions", PROBE, {header: value, **auth})
        assert status == 400 and body["error"]["param"] == header, (base, body)
        assert header in body["error"]["message"]
