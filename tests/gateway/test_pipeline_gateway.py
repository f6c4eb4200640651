"""InferencePipelines through the gateway process, over a real runtime serving SmolLM2-135M-Instruct.

One `python -m goodput_runtime` process on the real model stands for the pods of two
InferenceServices: `chat` (the generator) and `guard` (the classifier, the same model asked
a question it answers reliably for obvious cases: whether a message is about food). The
pipelines are created in the API server while the gateway runs, and found by its watch.
Clients are the real `openai` SDK.
"""

from __future__ import annotations

import re
import time

import openai
import pytest
from gateway_helpers import GatewayProcess, Started, post_json, publish, wait_ready
from harness import wait_for
from pipeline_helpers import create_pipeline, install_pipeline_crd
from prometheus_process import PROMETHEUS, Prometheus, dashboard_queries

TOPIC = 'Is this message about food or cooking? Answer yes or no.\n\nMessage: "{input}"'
RULES = {
    "maxLength": 300,
    "deny": [{"name": "credentials", "pattern": "(?i)password\\s*[:=]"}],
    "pii": [{"type": "email", "action": "redact", "replacement": "[email]"}, {"type": "phone"}, {"type": "card"}],
}
SLO = {"ttft": "60s", "tpot": "10s"}  # generous: the CPU is shared, goodput should count every served request
ASK = [{"role": "user", "content": "How do I bake bread?"}]
# any key is the anonymous tenant; `tight`'s default TTFT target (1 ms) no prompt on this machine meets
TENANTS = "tenants:\n  anonymous: {}\n  tight: {keys: [sk-tight], slo: {ttftMs: 1}}\n"


def service_spec() -> dict:
    return {
        "model": {"source": "file:///models/smollm2", "servedName": "smol"},
        "resources": {"gpu": 0, "memory": "2Gi"},
        "slo": SLO,
    }


class Env:
    def __init__(self, cluster, namespace: str, gateway: GatewayProcess, runtime_url: str) -> None:
        self.cluster, self.namespace, self.gateway, self.runtime_url = cluster, namespace, gateway, runtime_url
        self.client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=120)
        self.prometheus: Prometheus | None = None
        self.started = time.time()

    def pipeline(self, name: str, steps: list[dict]) -> str:
        create_pipeline(self.cluster, self.namespace, name, steps)
        wait_for(
            lambda: any(m["id"] == name and m["ready"] for m in self.gateway.models()),
            30,
            f"the gateway to serve the pipeline {name}",
        )
        return name

    def post(self, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
        status, _, answer = post_json(self.gateway.url + path, body, timeout=120)
        return status, answer

    def metric(self, name: str, **labels: str) -> float:
        return self.gateway.metric(name, namespace=self.namespace, **labels)


@pytest.fixture(scope="module")
def env(cluster, smollm2_dir, tmp_path_factory):
    install_pipeline_crd(cluster)
    workdir = tmp_path_factory.mktemp("pipelines")
    namespace = f"pipe-{int(time.time()) % 100000}"
    with Started() as started:
        started.namespaces(cluster, namespace)
        runtime = started.replica(
            "smol",
            smollm2_dir,
            workdir,
            "--served-model-name",
            "smol",
            "--max-model-len",
            "1024",
            "--kv-cache-memory",
            "48Mi",
        )
        for name in ("chat", "guard"):
            cluster.create_service(namespace, name, service_spec())
        wait_ready(runtime)
        for name in ("chat", "guard"):
            publish(cluster, namespace, name, "p0", runtime.port)
        (workdir / "tenants.yaml").write_text(TENANTS)
        gateway = started.gateway(
            cluster.kubeconfig, workdir / "gateway.log", "--tenants-file", str(workdir / "tenants.yaml")
        )
        e = Env(cluster, namespace, gateway, f"http://127.0.0.1:{runtime.port}")
        if PROMETHEUS:  # scrapes the gateway throughout, for the dashboard's pipeline row
            e.prometheus = started.stops(Prometheus(workdir, namespace, None, (int(gateway.url.rsplit(":", 1)[1]),)))
        e.pipeline(
            "cooking",
            [
                {"name": "input-rules", "kind": "guard", "rules": RULES},
                {
                    "name": "on-topic",
                    "kind": "guard",
                    "classifier": {"service": "guard", "template": TOPIC, "allow": ["yes"], "block": ["no"]},
                },
                {"name": "persona", "kind": "template", "system": "You are a helpful cooking assistant."},
                {
                    "name": "answer",
                    "kind": "generate",
                    "service": "chat",
                    "defaults": {"temperature": 0, "maxTokens": 16},
                },
            ],
        )
        e.pipeline(
            "rules-only",
            [
                {"name": "input-rules", "kind": "guard", "rules": RULES},
                {"name": "echo", "kind": "template", "prompt": "Say: {input}"},
                {"kind": "generate", "service": "chat"},
            ],
        )
        yield e
    assert not gateway.tracebacks(), gateway.tracebacks()


def test_models_lists_the_pipeline_and_an_on_topic_question_is_served(env):
    card = next(m for m in env.gateway.models() if m["id"] == "cooking")
    assert card["steps"] == "guard:input,guard:input,template,generate" and card["ready"] is True
    answer = env.client.chat.completions.create(model="cooking", messages=ASK)
    assert answer.model == "cooking"
    assert answer.choices[0].finish_reason == "length" and len(answer.choices[0].message.content) > 10
    assert answer.usage.completion_tokens == 16  # the generate step's default maxTokens


def test_the_classifier_refuses_an_off_topic_question_in_openais_shape(env):
    with pytest.raises(openai.BadRequestError) as err:
        env.client.chat.completions.create(
            model="cooking", messages=[{"role": "user", "content": "Who won the football world cup in 1998?"}]
        )
    assert err.value.status_code == 400 and err.value.code == "content_filter"
    assert err.value.body["type"] == "invalid_request_error"
    assert "classifier 'guard'" in err.value.message and "step 'on-topic'" in err.value.message


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("x" * 301, "max-length"),
        ("my password: hunter2, now bake bread", "credentials"),
        ("call me at +1 415 555 0132 about bread", "pii-phone"),
        ("charge 4111 1111 1111 1111 for the flour", "pii-card"),
    ],
)
def test_each_input_rule_refuses_naming_the_rule_and_never_logs_the_text(env, text, rule):
    status, body = env.post({"model": "rules-only", "messages": [{"role": "user", "content": text}]})
    assert status == 400, body
    assert body["error"]["code"] == "content_filter" and f"rule '{rule}'" in body["error"]["message"]
    assert text not in body["error"]["message"]
    log = env.gateway.log()
    assert f"rule {rule}" in log
    for secret in ("hunter2", "4111 1111", "555 0132"):
        assert secret not in log


def test_an_email_in_the_prompt_is_redacted_before_the_model_sees_it(env):
    """echo returns the prompt as the runtime received it: the template applied, the address replaced."""
    status, body = env.post(
        {"model": "rules-only", "prompt": "write to ann@example.com", "echo": True, "max_tokens": 1}, "/v1/completions"
    )
    assert status == 200, body
    assert body["choices"][0]["text"].startswith("Say: write to [email]")


def stream_direct(env, max_tokens: int) -> list[str]:
    """The generator's own streamed answer to ASK at temperature 0, chunk by chunk (no pipeline)."""
    direct = openai.OpenAI(base_url=env.runtime_url + "/v1", api_key="none", max_retries=0, timeout=120)
    chunks = direct.chat.completions.create(
        model="smol", messages=ASK, temperature=0, max_tokens=max_tokens, stream=True
    )
    return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]


def spanning_phrase(pieces: list[str]) -> tuple[str, int]:
    """A phrase of the answer that starts inside one chunk and ends two chunks later; where it first occurs."""
    starts = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    full = "".join(pieces)
    for i in range(2, len(pieces) - 3):
        if len(pieces[i]) >= 2 and pieces[i + 2]:
            phrase = full[starts[i] + 1 : starts[i + 2] + max(1, len(pieces[i + 2]) // 2)]
            return phrase, full.index(phrase)
    raise AssertionError(f"no phrase spans three chunks in {pieces}")


def test_output_guards_catch_a_match_split_across_chunks_mid_stream(env):
    pieces = stream_direct(env, 24)
    full = "".join(pieces)
    phrase, at = spanning_phrase(pieces)
    pattern = re.escape(phrase)
    base = [{"kind": "generate", "service": "chat", "defaults": {"temperature": 0, "maxTokens": 24}}]
    env.pipeline(
        "stream-block",
        [
            *base,
            {
                "name": "out",
                "kind": "guard",
                "stage": "output",
                "holdBack": 32,
                "rules": {"deny": [{"name": "phrase", "pattern": pattern}]},
            },
        ],
    )
    env.pipeline(
        "stream-redact",
        [
            *base,
            {
                "name": "out",
                "kind": "guard",
                "stage": "output",
                "holdBack": 32,
                "rules": {"deny": [{"name": "phrase", "pattern": pattern, "action": "redact", "replacement": "<cut>"}]},
            },
        ],
    )

    filtered_before = env.metric("goodput_pipeline_requests_total", pipeline="stream-block", outcome="filtered")
    chunks = list(env.client.chat.completions.create(model="stream-block", messages=ASK, stream=True))
    sent = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert chunks[-1].choices[0].finish_reason == "content_filter"
    assert "".join(sent) == full[:at]  # everything before the match, nothing of it
    assert not any(phrase in s for s in sent)
    assert (
        env.metric("goodput_pipeline_requests_total", pipeline="stream-block", outcome="filtered")
        == filtered_before + 1
    )
    assert env.metric("goodput_guard_blocks_total", pipeline="stream-block", rule="phrase") >= 1

    chunks = list(env.client.chat.completions.create(model="stream-redact", messages=ASK, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.replace(phrase, "<cut>")
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")

    whole = env.client.chat.completions.create(model="stream-redact", messages=ASK)
    assert whole.choices[0].message.content == full.replace(phrase, "<cut>")


def test_a_pipeline_with_output_guards_refuses_fields_that_would_show_held_text(env):
    status, body = env.post({"model": "stream-block", "messages": ASK, "logprobs": True})
    assert status == 400 and body["error"]["param"] == "logprobs"
    status, body = env.post({"model": "stream-block", "messages": ASK, "n": 2})
    assert status == 400 and body["error"]["param"] == "n"


def test_the_pipelines_goodput_metrics_count_every_outcome_end_to_end(env):
    before = {
        o: env.metric("goodput_pipeline_requests_total", pipeline="cooking", outcome=o) for o in ("served", "refused")
    }
    good = env.metric("goodput_pipeline_requests_good_total", pipeline="cooking")
    list(env.client.chat.completions.create(model="cooking", messages=ASK, stream=True))
    with pytest.raises(openai.BadRequestError):
        env.client.chat.completions.create(model="cooking", messages=[{"role": "user", "content": "password=x"}])
    assert env.metric("goodput_pipeline_requests_total", pipeline="cooking", outcome="served") >= before["served"] + 1
    assert env.metric("goodput_pipeline_requests_total", pipeline="cooking", outcome="refused") == before["refused"] + 1
    assert env.metric("goodput_pipeline_requests_good_total", pipeline="cooking") >= good + 1
    assert env.metric("goodput_guard_blocks_total", pipeline="cooking", rule="credentials") >= 1
    for step, kind in (
        ("input-rules", "guard"),
        ("on-topic", "guard"),
        ("persona", "template"),
        ("answer", "generate"),
    ):
        assert (
            env.metric("goodput_pipeline_step_duration_seconds_count", pipeline="cooking", step=step, kind=kind) >= 1
        ), step
    assert env.metric("goodput_pipeline_time_to_first_token_seconds_count", pipeline="cooking") >= 1


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus missing (make prometheus)")
def test_every_pipeline_panel_of_the_dashboard_returns_data(env):
    assert env.prometheus is not None
    values = {"$namespace": env.namespace, "$pipeline": ".*", "$__rate_interval": "10s"}
    queries = dashboard_queries(values, lambda expr: "goodput_pipeline_" in expr or "goodput_guard_" in expr)
    assert len(queries) >= 6
    empty = env.prometheus.panels_without_data(queries, env.started)
    assert not empty, f"no data for: {empty}"


def test_a_tenants_default_target_reaches_the_runtime_through_a_pipeline(env):
    """The generate step carries the tenant's own TTFT target: the runtime's admission refuses it (429 with
    Retry-After, in OpenAI's shape) where the same request of the anonymous tenant is served."""
    body = {"model": "rules-only", "messages": ASK, "max_tokens": 2}
    status, headers, answer = post_json(
        env.gateway.url + "/v1/chat/completions", body, {"Authorization": "Bearer sk-tight"}
    )
    assert status == 429 and answer["error"]["code"] == "slo_unattainable", answer
    assert int(headers["Retry-After"]) >= 1
    assert env.post(body)[0] == 200
