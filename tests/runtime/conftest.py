"""The runtime tier's fixtures: real servers (server_thread.ServerThread, the production ``serve()`` on a
free port in a thread), runtime processes, the native kernels, and Triton's interpreter."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from helpers import stop_process, tier
from server_thread import SMALL_KV, ServerThread

pytest_collection_modifyitems = tier(__file__, "runtime")


@pytest.fixture(scope="session")
def kernel() -> None:
    """The native extension (layers/native_attention.py: the attention kernels and fused functions),
    built; the test is skipped where it cannot be."""
    from goodput_runtime.layers import native_attention

    if not native_attention.available():
        pytest.skip(
            "the native extension cannot be built here (no C++ compiler, or the build failed: see the "
            "log); the torch path serves instead"
        )


@pytest.fixture(scope="session")
def avx512_kernel(kernel: None) -> None:
    """The native extension's AVX-512 paths (the prompt kernel, the fused functions in bfloat16): skipped
    on a CPU without AVX-512 (AVX2 only), where those hand back to the torch operations."""
    from goodput_runtime.layers import cpu_dtype

    if "avx512f" not in cpu_dtype.cpu_flags():
        pytest.skip("this CPU has no AVX-512 (avx512f): the prompt kernel falls back to torch here")


@pytest.fixture(scope="session")
def fused_kernel(kernel: None) -> None:
    """The native extension's fused element-wise functions (layers/fused.py): float32 on AVX2 with FMA,
    float32 and bfloat16 on AVX-512; skipped on a CPU with neither, where they hand back to torch."""
    from goodput_runtime.layers import cpu_dtype

    flags = cpu_dtype.cpu_flags()
    if "avx512f" not in flags and not {"avx2", "fma"} <= flags:
        pytest.skip("this CPU has neither AVX-512 nor AVX2 with FMA: the fused functions fall back to torch here")


async def sse_events(response: Any) -> list[str]:
    """Every ``data:`` payload of a server-sent event stream (an aiohttp response), in order."""
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events, buffer = [], b""
    async for piece in response.content.iter_any():
        buffer += piece
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            assert block.startswith(b"data: "), block
            events.append(block[len(b"data: ") :].decode())
    assert buffer == b""
    return events


@pytest.fixture
def read_sse() -> Callable[[Any], Any]:
    return sse_events


@pytest.fixture
def make_server(tiny_model_dir: Path) -> Iterator[Callable[..., ServerThread]]:
    """Servers with settings (or a model directory) of their own, stopped when the test ends."""
    started: list[ServerThread] = []

    def make(
        start: bool = True, wait_ready: bool = True, model_dir: Path | None = None, **settings: Any
    ) -> ServerThread:
        running = ServerThread(model_dir or tiny_model_dir, **settings)
        started.append(running)
        return running.start(wait_ready) if start else running

    yield make
    for running in started:
        running.stop()


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    """The shared server: the tiny chat model, small KV cache, 256-token context."""
    running = ServerThread(tiny_model_dir).start()
    yield running
    running.stop()


@pytest.fixture(scope="session")
def long_server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    """Room for requests that run for seconds: a 2,048-token context."""
    running = ServerThread(tiny_model_dir, max_model_len=2048, kv_cache_memory=2 * SMALL_KV).start()
    yield running
    running.stop()


@pytest.fixture(scope="session")
def no_chat_server(tiny_model_no_chat_dir: Path) -> Iterator[ServerThread]:
    running = ServerThread(tiny_model_no_chat_dir).start()
    yield running
    running.stop()


@pytest.fixture
def openai_client(server: ServerThread) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


class RuntimeProcess:
    """``python -m goodput_runtime`` as a real child process on a free port, its log in a file."""

    def __init__(self, model_dir: Path, log_path: Path, *flags: str) -> None:
        self.log_path = log_path
        self.log_file = log_path.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "goodput_runtime",
                "--model",
                str(model_dir),
                "--served-model-name",
                "tiny",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--max-model-len",
                "2048",
                "--kv-cache-memory",
                "2Mi",
                *flags,
            ],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
        )
        port = self.wait_for_log(r"Listening on http://127\.0\.0\.1:(\d+)")
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while not (match := re.search(pattern, self.log())):
            assert self.process.poll() is None, f"the runtime exited early:\n{self.log()}"
            assert time.monotonic() < deadline, f"no {pattern!r} in the log:\n{self.log()}"
            time.sleep(0.05)
        return match.group(1) if match.groups() else match.group(0)

    async def health(self, http: aiohttp.ClientSession) -> int:
        async with http.get(f"{self.url}/health") as response:
            return response.status

    async def wait_health(self, http: aiohttp.ClientSession, status: int) -> None:
        deadline = time.monotonic() + 60
        while await self.health(http) != status:
            assert time.monotonic() < deadline, self.log()
            await asyncio.sleep(0.05)

    def close(self) -> None:
        stop_process(self.process, timeout=0)  # killed at once: a drain is what the tests send SIGTERM for
        self.log_file.close()


@pytest.fixture
def runtime(tiny_model_dir: Path, tmp_path: Path) -> Iterator:
    """Start real runtime processes on the tiny model; each is killed at the end if still running."""
    started: list[RuntimeProcess] = []

    def start(*flags: str) -> RuntimeProcess:
        started.append(RuntimeProcess(tiny_model_dir, tmp_path / f"runtime-{len(started)}.log", *flags))
        return started[-1]

    yield start
    for process in started:
        process.close()


@pytest.fixture
def interpret(monkeypatch):
    """Triton's interpreter where there is no GPU (tests/conftest.py sets TRITON_INTERPRET before Triton is
    imported). Its scalars are one-element numpy arrays, which numpy 2.4 no longer converts with
    int(): a loop bound loaded from memory is converted with .item() instead (a fix to the
    interpreter, not to the kernel)."""
    if torch.cuda.is_available():
        return
    from goodput_runtime.layers import triton_attention

    assert triton_attention.interpreting()
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)
