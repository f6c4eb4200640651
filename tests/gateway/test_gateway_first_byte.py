"""The gateway retries a replica lost before the client got a byte, and counts each retry.

A real `python -m goodput_gateway` process discovers one service from the real API server
with three endpoints: a real runtime process on the tiny model; a port where nothing listens
(refused: reason `connect`); and a replica that dies after its response headers, before the
body's first byte. A runtime cannot be killed at that exact instant on purpose, so the last is
a socket in this test that reads the request, sends a streaming response's headers and closes
the connection: the fault, injected at the one moment it is about. Every streamed request
must come back whole through the official `openai` SDK (no client retries), and
`goodput_gateway_retries_total` must count each drop as `reset` and each refusal as `connect`.
"""

from __future__ import annotations

import socket
import threading
import time

import helpers
import openai
import pytest
from autoscaling_helpers import free_port
from gateway_helpers import Started, publish, tiny_spec, wait_ready

pytestmark = pytest.mark.faults

HEADERS = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Cache-Control: no-cache\r\n\r\n"
)


class DiesAfterHeaders:
    """A listening socket that answers every request with a stream's headers, then closes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("0.0.0.0", 0))
        self.port = self.sock.getsockname()[1]
        self.dropped = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if b"/v1/" in data.split(b"\r\n", 1)[0]:  # the gateway's load scrapes get the same
                    self.dropped += 1
                conn.sendall(HEADERS)
                conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


def test_a_replica_lost_after_its_headers_is_retried_and_counted(cluster, namespace, tiny_model_dir, tmp_path):
    with Started() as started:
        replica = started.replica("real", tiny_model_dir, tmp_path)
        dying = DiesAfterHeaders()
        started.callback(dying.close)
        cluster.create_service(namespace, "tiny", tiny_spec(replicas=3, routing={"policy": "random"}))
        wait_ready(replica)
        publish(cluster, namespace, "tiny", "real", replica.port)
        publish(cluster, namespace, "tiny", "dies-after-headers", dying.port)
        publish(cluster, namespace, "tiny", "refuses", free_port())
        gateway = started.gateway(cluster.kubeconfig, tmp_path / "gateway.log")
        listed = helpers.wait_for(
            lambda: [m for m in gateway.models() if m["namespace"] == namespace and m["ready_replicas"] == 3],
            60,
            "the gateway to see three endpoints",
            every=0.25,
            explain=lambda: str(gateway.models()),
        )
        model = listed[0]["id"]
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        labels = {"namespace": namespace, "service": "tiny"}

        def retries(reason: str) -> float:
            return gateway.metric("goodput_gateway_retries_total", reason=reason, **labels)

        for i in range(40):
            stream = client.chat.completions.create(
                model=model,
                stream=True,
                max_tokens=6,
                temperature=0,
                messages=[{"role": "user", "content": f"hello {i}"}],
            )
            chunks = list(stream)
            assert chunks and chunks[-1].choices[0].finish_reason == "length", chunks[-1:]
            if dying.dropped >= 2 and retries("connect") >= 1:
                break
            time.sleep(1.1)  # past half the 2 s a failed replica sits out, so it is picked again
        assert dying.dropped >= 1, "no request met the replica that dies after its headers"
        assert retries("reset") == dying.dropped
        assert retries("connect") >= 1, "no request met the endpoint that refuses"
