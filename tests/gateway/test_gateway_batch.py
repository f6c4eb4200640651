"""The Batch API through the real `openai` SDK: a gateway process in front of a real runtime process.

The gateway serves the runtime as a static model (no cluster needed for batch work); its store
is SQLite on disk, and, in the last test, a real PostgreSQL server shared by two gateways.
The durability test SIGKILLs the gateway in the middle of a batch and starts it again.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import openai
import pytest
from gateway_helpers import ROOT, GatewayProcess, Started, metric, post_json, wait_ready
from harness import wait_for
from postgres_server import PostgresServer

pytestmark = pytest.mark.slow

LEASE = "2"  # seconds before a dead gateway's lines go back to the pool


def lines(n: int, max_tokens: int = 4, bad: set[int] = frozenset(), prefix: str = "q") -> bytes:
    out = []
    for i in range(n):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if i in bad:
            body["temperature"] = 7  # the runtime refuses it: a 400 in the error file
        out.append(
            json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        )
    return ("\n".join(out) + "\n").encode()


class Env:
    def __init__(self, workdir: Path, replica_url: str, started: Started) -> None:
        self.workdir, self.replica_url, self.started = workdir, replica_url, started
        self.gateways: list[GatewayProcess] = []

    def gateway(self, database: str, name: str = "gateway") -> GatewayProcess:
        g = self.started.gateway(
            self.workdir / "no-kubeconfig",
            self.workdir / f"{name}.log",
            "--static-model",
            f"tiny={self.replica_url}",
            "--database",
            database,
            "--batch-lease-seconds",
            LEASE,
            "--shutdown-delay",
            "0",
            "--shutdown-grace",
            "2",
        )
        self.gateways.append(g)
        return g

    @staticmethod
    def client(g: GatewayProcess) -> openai.OpenAI:
        return openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("batch")
    with Started() as started:
        replica = started.replica("r0", tiny_model_dir, workdir)
        wait_ready(replica)
        yield Env(workdir, f"http://127.0.0.1:{replica.port}", started)


def run_batch(client: openai.OpenAI, data: bytes, timeout: float = 120, **extra):
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", **extra)
    return f, batch


def wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 120, seen: list | None = None):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if seen is not None:
            seen.append((b.status, b.request_counts.completed, b.request_counts.failed))
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.status}"
        time.sleep(0.2)


def output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.decode().splitlines()]


def test_the_sdk_flow_end_to_end(env):
    g = env.gateway(f"sqlite:///{env.workdir}/flow.db", "flow")
    client = env.client(g)
    batch_lines_before = metric(env.replica_url, "goodput_requests_by_priority_total", priority="batch")
    f, batch = run_batch(client, lines(20, bad={7}), metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    assert client.files.retrieve(f.id).purpose == "batch"
    seen: list = []
    done = wait_done(client, batch.id, seen=seen)
    assert done.status == "completed"
    assert done.request_counts.total == 20
    assert (done.request_counts.completed, done.request_counts.failed) == (19, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    # the statuses a poller saw only move forward (a fast batch may pass in_progress between two
    # polls: in_progress_at above says it was there)
    order = ["validating", "in_progress", "finalizing", "completed"]
    statuses = [order.index(s) for s, *_ in seen]
    assert statuses == sorted(statuses) and seen[-1][0] == "completed" and done.in_progress_at >= batch.created_at
    out = output_lines(client, done.output_file_id)
    errors = output_lines(client, done.error_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"q-{i}" for i in range(20) if i != 7)
    for o in out:
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert o["response"]["body"]["object"] == "chat.completion"
        assert o["response"]["body"]["choices"][0]["message"]["content"]
        assert o["response"]["body"]["usage"]["completion_tokens"] <= 4
    assert [e["custom_id"] for e in errors] == ["q-7"]
    assert errors[0]["response"]["status_code"] == 400
    assert "temperature" in errors[0]["response"]["body"]["error"]["message"]
    # the runtime ran every line it accepted (all but the refused one) at batch priority
    assert metric(env.replica_url, "goodput_requests_by_priority_total", priority="batch") >= batch_lines_before + 19
    assert g.metric("goodput_batch_requests_total", state="completed") == 19
    assert g.metric("goodput_batch_lines_pending") == 0
    assert g.metric("goodput_batch_service_lines_pending") == 0
    listed = client.batches.list(limit=5)
    assert done.id in [b.id for b in listed.data]
    assert {x.id for x in client.files.list().data} >= {f.id, done.output_file_id, done.error_file_id}
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(openai.APIStatusError) as err:
        client.batches.cancel(done.id)
    assert err.value.status_code == 409


def post_replica(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    status, _, answer = post_json(url + "/v1/chat/completions", body, headers)
    return status, answer


def test_the_runtime_takes_priority_from_the_body_or_the_gateways_header(env):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def batch_count() -> float:
        return metric(env.replica_url, "goodput_requests_by_priority_total", priority="batch")

    before = batch_count()
    assert post_replica(env.replica_url, {**chat, "priority": 5})[0] == 200
    assert post_replica(env.replica_url, chat, {"X-Goodput-Priority": "batch"})[0] == 200
    assert batch_count() == before + 2
    # the body wins over the header: an online request stays online
    online = metric(env.replica_url, "goodput_requests_by_priority_total", priority="online")
    assert post_replica(env.replica_url, {**chat, "priority": 0}, {"X-Goodput-Priority": "batch"})[0] == 200
    assert metric(env.replica_url, "goodput_requests_by_priority_total", priority="online") == online + 1
    status, body = post_replica(env.replica_url, {**chat, "priority": "high"})
    assert status == 400 and body["error"]["param"] == "priority"
    status, body = post_replica(env.replica_url, chat, {"X-Goodput-Priority": "urgent"})
    assert status == 400 and body["error"]["param"] == "X-Goodput-Priority"


def test_bad_input_is_refused_with_its_line_and_a_bad_batch_names_its_field(env):
    g = env.gateway(f"sqlite:///{env.workdir}/refuse.db", "refuse")
    client = env.client(g)
    good = lines(2).decode().splitlines()
    duplicate = good[0]
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("in.jsonl", io.BytesIO("\n".join([*good, duplicate]).encode())), purpose="batch")
    assert "Line 3" in err.value.message and "q-0" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("in.jsonl", io.BytesIO(lines(2))), purpose="fine-tune")
    assert err.value.body["param"] == "purpose"
    f = client.files.create(file=("in.jsonl", io.BytesIO(lines(2))), purpose="batch")
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    assert err.value.body["param"] == "completion_window"
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", extra_body={"priority": 3}
        )
    assert err.value.body["param"] == "priority"
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h")
    assert err.value.body["param"] == "input_file_id"
    # a model nobody serves: the batch is created, then fails validation, naming the line
    other = lines(2).replace(b'"model": "tiny"', b'"model": "nobody"')
    _, batch = run_batch(client, other)
    failed = wait_done(client, batch.id, timeout=30)
    assert failed.status == "failed" and failed.errors.data[0].code == "model_not_found"
    # the wrong endpoint for the file's lines
    mismatch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert wait_done(client, mismatch.id, timeout=30).errors.data[0].code == "invalid_url"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nothing")


def test_a_gateway_killed_mid_batch_loses_and_duplicates_nothing(env):
    database = f"sqlite:///{env.workdir}/kill.db"
    g = env.gateway(database, "kill-1")
    client = env.client(g)
    n = 80
    _, batch = run_batch(client, lines(n, max_tokens=24, prefix="k"))
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 10, 60, "ten lines done")
    assert g.metric("goodput_batch_service_lines_pending") > 0  # what spec.batch.maxReplicas scales on
    g.process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
    g.process.wait()  # type: ignore[union-attr]
    done_at_kill = None
    g2 = env.gateway(database, "kill-2")
    client2 = env.client(g2)
    done_at_kill = client2.batches.retrieve(batch.id)
    assert done_at_kill.status == "in_progress" and done_at_kill.request_counts.completed < n
    done = wait_done(client2, batch.id)
    assert done.status == "completed" and done.request_counts.completed == n
    out = output_lines(client2, done.output_file_id)
    counts = Counter(o["custom_id"] for o in out)
    assert set(counts) == {f"k-{i}" for i in range(n)}
    assert max(counts.values()) == 1
    assert done.error_file_id is None


def test_two_gateways_share_a_postgresql_store_and_never_run_a_line_twice(env):
    server = PostgresServer().start()
    try:
        database = server.fresh_database("batches")
        a, b = env.gateway(database, "pg-a"), env.gateway(database, "pg-b")
        n = 60
        _, batch = run_batch(env.client(a), lines(n, max_tokens=8, prefix="p"))
        done = wait_done(env.client(b), batch.id)  # either gateway answers for any batch
        assert done.status == "completed" and done.request_counts.completed == n
        out = output_lines(env.client(b), done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(f"p-{i}" for i in range(n))
        # each line was recorded by exactly one gateway
        recorded = [g.metric("goodput_batch_requests_total", state="completed") for g in (a, b)]
        assert sum(recorded) == n
    finally:
        for g in env.gateways:
            g.stop()
        server.stop()


def test_serving_gateways_relay_the_batch_api_to_the_one_that_owns_the_store(env):
    """The chart's default: the serving gateways open no store and pass /v1/files and /v1/batches to
    the batch-owning gateway; a client of either sees one Batch API, and chat goes on when it is gone."""
    owner = env.gateway(f"sqlite:///{env.workdir}/relay.db", "relay-owner")
    serving = env.started.gateway(
        env.workdir / "no-kubeconfig",
        env.workdir / "relay-serving.log",
        "--static-model",
        f"tiny={env.replica_url}",
        "--batch-url",
        owner.url,
        "--shutdown-delay",
        "0",
    )
    env.gateways.append(serving)
    client = env.client(serving)
    f, batch = run_batch(client, lines(6, prefix="r"), metadata={"via": "relay"})
    assert client.files.retrieve(f.id).bytes == len(lines(6, prefix="r"))
    done = wait_done(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 6 and done.metadata == {"via": "relay"}
    assert sorted(o["custom_id"] for o in output_lines(client, done.output_file_id)) == [f"r-{i}" for i in range(6)]
    # the owner ran the lines; the serving gateway only relayed them
    assert owner.metric("goodput_batch_requests_total", state="completed") == 6
    assert env.client(owner).batches.retrieve(batch.id).status == "completed"
    with pytest.raises(openai.NotFoundError):  # the owner's own errors come back as they were
        client.batches.retrieve("batch_nothing")
    owner.stop()
    with pytest.raises(openai.APIStatusError) as gone:
        client.batches.list()
    assert gone.value.status_code == 503 and gone.value.code == "batch_api_unavailable"
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    assert answer.choices[0].message.content is not None


def test_the_demos_batch_step_prints_each_answer(env):
    """hack/demo_batch.py, what `make demo` runs after its question, through a serving gateway that relays
    the Batch API to the store's owner (the default install)."""
    owner = env.gateway(f"sqlite:///{env.workdir}/demo.db", "demo-owner")
    serving = env.started.gateway(
        env.workdir / "no-kubeconfig",
        env.workdir / "demo-serving.log",
        "--static-model",
        f"tiny={env.replica_url}",
        "--batch-url",
        owner.url,
        "--shutdown-delay",
        "0",
    )
    env.gateways.append(serving)
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "hack" / "demo_batch.py"),
            "--base-url",
            serving.url + "/v1",
            "--model",
            "tiny",
            "--timeout",
            "120",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "files.create    -> file-" in run.stdout and "batches.create  -> batch_" in run.stdout
    assert "completed (3/3 done)" in run.stdout
    for i, question in enumerate(("What is the capital of Italy?", "Name a primary colour.", "What is 2 + 2?"), 1):
        # each answer printed as a Python literal, in whichever quotes its text allows
        assert f"q{i}: {question}\n    '" in run.stdout or f'q{i}: {question}\n    "' in run.stdout, run.stdout
    # a model nobody serves: the batch fails and the step says so
    refused = subprocess.run(
        [
            sys.executable,
            str(ROOT / "hack" / "demo_batch.py"),
            "--base-url",
            serving.url + "/v1",
            "--model",
            "nobody",
            "--timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1 and "the batch ended failed" in refused.stderr, refused.stdout + refused.stderr
