"""A service's only replica crashes under a request that has had no byte yet: the gateway holds the request
until a replica it has not failed on is ready, and the client gets its answer, not a 503.

Real runtime processes, discovered by a real gateway from a real API server's EndpointSlices, which the
test writes as the EndpointSlice controller would: the crashed replica still listed ready for a moment (the
kubelet has not seen the crash yet), then not ready, then a new replica ready. A replica that stays listed
after failing a request is tried again once the wait for it to leave is over.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest
from gateway_helpers import Started, metric, publish, tiny_spec, wait_ready
from harness import wait_for

from goodput_contract import metrics as names

pytestmark = pytest.mark.slow

LONG = {"max_tokens": 300, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_a_request_on_a_lone_replica_that_crashes_is_answered_by_its_replacement(cluster, tiny_model_dir, tmp_path):
    namespace = f"gwlone-{int(time.time()) % 100000}"
    with Started() as started:
        started.namespaces(cluster, namespace)
        first = started.replica("first", tiny_model_dir, tmp_path)
        cluster.create_service(namespace, "chat", tiny_spec())
        wait_ready(first)
        publish(cluster, namespace, "chat", "first", first.port)
        g = started.gateway(cluster.kubeconfig, tmp_path / "gateway.log", "--scrape-seconds", "0.3")
        client = openai.OpenAI(base_url=f"{g.url}/v1", max_retries=0, timeout=120, api_key="none")
        wait_for(lambda: client.completions.create(model="tiny", prompt="warm", max_tokens=1), 60, "a first answer")

        outcome: dict[str, object] = {}

        def ask() -> None:  # not streamed: the client gets its first byte only with the whole answer
            try:
                outcome["answer"] = client.completions.create(model="tiny", prompt="Once upon a time", **LONG)
            except openai.APIError as err:
                outcome["error"] = err

        asker = threading.Thread(target=ask)
        asker.start()
        url = f"http://127.0.0.1:{first.port}"
        wait_for(lambda: metric(url, names.REQUESTS_RUNNING) >= 1, 30, "the request running on the replica")
        first.process.kill()  # a crash: the replica is still listed ready
        time.sleep(1.0)  # the gateway meets the dead replica; nothing else can take the request
        assert asker.is_alive(), outcome
        publish(cluster, namespace, "chat", "first", first.port, ready=False)  # the kubelet saw the crash
        second = started.replica("second", tiny_model_dir, tmp_path)
        wait_ready(second)
        publish(cluster, namespace, "chat", "second", second.port)
        asker.join(120)
        assert not asker.is_alive()
        assert "error" not in outcome, outcome.get("error")
        answer = outcome["answer"]
        assert isinstance(answer, openai.types.Completion)
        assert answer.usage is not None and answer.usage.completion_tokens == LONG["max_tokens"]
        labels = {"namespace": namespace, "service": "chat"}
        assert g.metric(names.GATEWAY_RETRIES, **labels, reason="reset") >= 1
        assert metric(f"http://127.0.0.1:{second.port}", names.REQUESTS, outcome="success") >= 1

        # a replica that fails a request and stays listed is tried again after the wait, then the client
        # is told: the answer is bounded, a 503 naming the replicas tried, not a hang
        second.process.kill()
        began = time.monotonic()
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model="tiny", prompt="hello", max_tokens=4)
        waited = time.monotonic() - began
        assert caught.value.status_code == 503 and "No replica of 'tiny' answered" in caught.value.message
        assert 15 < waited < 90, waited
        assert "Traceback" not in g.log()
