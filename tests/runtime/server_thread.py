"""The runtime's production ``serve()`` on a free port, in a thread of its own: `ServerThread`, which
conftest.py's fixtures start and tests that need their own server import (a module of its own, not the
conftest, so that the import finds it whichever test directories a run collects).

The server gets its own event loop in a background thread, so tests can talk to it with
blocking clients (the official ``openai`` package) as well as with aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import wait_for

from goodput_runtime.config import EngineConfig
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.server.lifecycle import load_engine, serve

MODEL_NAME = "tiny"
SMALL_KV = 1 << 20  # 2,048 tokens of the tiny model


def get(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            status, raw, kind = response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        status, raw, kind = exc.code, exc.read(), exc.headers.get("Content-Type", "")
    return status, json.loads(raw) if "json" in kind else raw.decode()


class ServerThread:
    def __init__(
        self,
        model_dir: Path,
        shutdown_grace: float = 5.0,
        slo_ttft: float | None = 0.5,
        slo_tpot: float | None = 0.05,
        engine_factory: Callable[..., Any] = load_engine,
        **engine_settings: Any,
    ) -> None:
        settings = {
            "max_model_len": 256,
            "kv_cache_memory": SMALL_KV,
            "max_num_batched_tokens": 256,
            "device": "cpu",
            "dtype": "float32",
            **engine_settings,
        }
        self.config = EngineConfig(model=str(model_dir), served_model_name=MODEL_NAME, **settings)
        self.metrics = RuntimeMetrics(MODEL_NAME, slo_ttft, slo_tpot)
        self.shutdown_grace = shutdown_grace
        self.engine_factory = engine_factory
        self.model = MODEL_NAME
        self.engine: Any = None
        self.port = 0
        self.exit_code: int | None = None
        self.listening = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self.main()), name="test-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def make_engine(self, config: EngineConfig, metrics: RuntimeMetrics) -> Any:
        self.engine = self.engine_factory(config, metrics)
        return self.engine

    async def main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.stop_event = asyncio.Event()

        def on_listening(port: int) -> None:
            self.port = port
            self.listening.set()

        self.exit_code = await serve(
            self.config,
            self.metrics,
            "127.0.0.1",
            0,
            self.shutdown_grace,
            self.stop_event,
            engine_factory=self.make_engine,
            on_listening=on_listening,
            **self.serve_options(),
        )

    def serve_options(self) -> dict[str, Any]:
        """More of serve()'s keyword arguments, for a subclass to add."""
        return {}

    def start(self, wait_ready: bool = True) -> ServerThread:
        self.thread.start()
        if not self.listening.wait(30):
            raise AssertionError("the server never started listening")
        if wait_ready:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        wait_for(lambda: get(f"{self.url}/health")[0] == 200, 60, "the server to become ready", every=0.02)

    def get(self, path: str) -> tuple[int, dict | str]:
        return get(f"{self.url}{path}")

    def request_stop(self) -> None:
        """What SIGTERM does in ``python -m goodput_runtime``."""
        self.loop.call_soon_threadsafe(self.stop_event.set)

    def stop(self, timeout: float = 30) -> int | None:
        if self.thread.is_alive():
            self.request_stop()
            self.thread.join(timeout)
        return self.exit_code

    def metric(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, {"model": MODEL_NAME, **labels})
        return value or 0.0

    def idle(self) -> bool:
        engine = self.engine
        return not engine.num_streams and engine.num_free_blocks == engine.num_total_blocks

    def wait_idle(self, timeout: float = 30) -> None:
        """Every request gone and every KV block free again."""
        wait_for(self.idle, timeout, "every KV block to be free", every=0.02)
