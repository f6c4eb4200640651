"""A batch on a real node: 50 lines through the gateway's Batch API to a real runtime pod.

The gateway runs here as a process with the batch API on (SQLite in a temporary directory),
discovering the InferenceService and its ready pod from the cluster as the installed gateway
does, and reaching the pod at its IP (this machine is the node). The batch is created,
completed and downloaded with the `openai` SDK, and its output is checked line by line.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
from node import ROOT, Node, condition, wait_for

NAME = "batchy"
LINES = 50
MAX_TOKENS = 6


def service_manifest() -> dict[str, Any]:
    return {
        "apiVersion": "serving.goodput.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"source": "pvc://models/tiny", "servedName": NAME, "maxModelLen": 256, "dtype": "float32"},
            "engine": {"maxNumSeqs": 16, "maxBatchedTokens": 256},
            "resources": {"gpu": 0, "cpu": "500m", "memory": "1Gi"},
            "slo": {"ttft": "2s", "tpot": "200ms"},
        },
    }


def gateway(node: Node, workdir: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    log = workdir / "gateway.log"
    env = {
        **os.environ,
        "KUBECONFIG": str(node.kubeconfig),
        "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("gateway", "operator", "contract")),
    }
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "goodput_gateway",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--database",
            f"sqlite:///{workdir}/batch.db",
        ],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    url = ""

    def listening() -> bool:
        nonlocal url
        match = re.search(r"Listening on http://[^:]+:(\d+)", log.read_text(errors="replace"))
        if match:
            url = f"http://127.0.0.1:{match[1]}"
        assert proc.poll() is None, log.read_text()[-3000:]
        return bool(match)

    wait_for(listening, 60, "the gateway to listen")
    return proc, url, log


def ready_replicas(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/v1/models/{NAME}", timeout=5) as r:
            return int(json.loads(r.read())["ready_replicas"])
    except OSError:
        return 0


def test_a_50_line_batch_completes_through_the_gateway_on_a_runtime_pod(
    installed: Node, models: Any, tmp_path: Path
) -> None:
    node = installed
    node.apply(service_manifest())
    proc = None
    try:
        wait_for(
            lambda: condition(node.get("inferenceservice", NAME), "Ready").get("status") == "True",
            300,
            f"InferenceService {NAME} to report Ready=True",
            explain=node.describe,
        )
        proc, url, log = gateway(node, tmp_path)
        wait_for(
            lambda: ready_replicas(url) == 1,
            60,
            "the gateway to see the ready pod",
            explain=lambda: log.read_text()[-3000:],
        )
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        data = "".join(
            json.dumps(
                {
                    "custom_id": f"line-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": NAME,
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "messages": [{"role": "user", "content": f"Count to {i}"}],
                    },
                }
            )
            + "\n"
            for i in range(LINES)
        )
        f = client.files.create(file=("batch.jsonl", io.BytesIO(data.encode())), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        started = time.monotonic()
        while (batch := client.batches.retrieve(batch.id)).status not in (
            "completed",
            "failed",
            "expired",
            "cancelled",
        ):
            assert time.monotonic() - started < 300, (batch, log.read_text()[-3000:])
            time.sleep(1)
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
            LINES,
            LINES,
            0,
        )
        assert batch.error_file_id is None
        output = [json.loads(x) for x in client.files.content(batch.output_file_id).content.decode().splitlines()]
        assert sorted(o["custom_id"] for o in output) == sorted(f"line-{i}" for i in range(LINES))
        for o in output:
            assert o["error"] is None and o["response"]["status_code"] == 200, o
            body = o["response"]["body"]
            assert body["object"] == "chat.completion" and body["model"] == NAME
            assert body["choices"][0]["message"]["role"] == "assistant"
            assert body["choices"][0]["message"]["content"]
            assert 1 <= body["usage"]["completion_tokens"] <= MAX_TOKENS
        print(f"50-line batch through the gateway on a pod: {time.monotonic() - started:.1f} s")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        node.kubectl("delete", "inferenceservice", NAME, "--wait=false", check=False)
