"""Our server as a child process on a loopback port, ready once /health answers 200."""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.workload import WorkItem

REPO = Path(__file__).resolve().parents[1]


def ensure_model(model_dir: str, shape: str) -> None:
    """Make the model if missing, or again if it was made from a shape definition that no longer exists."""
    from dataclasses import asdict

    from goodput_runtime.tools.make_model import SHAPES, make_model

    record = Path(model_dir) / "goodput-model.json"
    if record.exists():
        made = json.loads(record.read_text()).get("shape")
        if any(made == asdict(known) for known in SHAPES.values()):
            return  # today's definition of this or another shape
        print(f"{model_dir} holds another shape than today's {shape}; making it again", flush=True)
    elif (Path(model_dir) / "config.json").exists():
        return  # a model from elsewhere: use it as it is
    else:
        print(f"making a {shape} model in {model_dir} ...", flush=True)
    make_model(model_dir, shape)


def kv_cache_bytes(model_dir: str, items: list[WorkItem], block_size: int) -> int:
    """fp32 KV bytes for every request's prompt + output at once, in whole blocks, plus one block each."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    blocks = sum(math.ceil((len(i.prompt_ids) + i.max_tokens) / block_size) + 1 for i in items)
    return blocks * block_size * per_token


@dataclass(frozen=True)
class Server:
    base_url: str
    pid: int


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux /proc), None where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def tree_cpu_seconds(pid: int) -> float:
    """CPU time so far of a process and every descendant (a server's engine and worker processes)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu_seconds(p) or 0.0
        todo += children.get(p, [])
    return total


def settle(pids: list[int], busy: float = 0.1, window_s: float = 0.5, limit_s: float = 30.0) -> float:
    """Wait until the servers `pids` (with their child processes) together use under `busy` of a core over
    `window_s`, at most `limit_s`; the seconds waited. A server just relieved of load may go on
    spinning for a while (vLLM's worker polls its message queue for about a second), and the next run
    would share the cores with it."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        before = sum(tree_cpu_seconds(p) for p in pids)
        time.sleep(window_s)
        if sum(tree_cpu_seconds(p) for p in pids) - before < busy * window_s:
            break
    return time.monotonic() - started


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(proc: subprocess.Popen, base_url: str, timeout: float, what: str, log_path: Path, every: float) -> None:
    """Until `base_url`/health answers 200; raises, naming the log, if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while not healthy(base_url + "/health"):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before ready; see {log_path}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:.0f} s; see {log_path}")
        time.sleep(every)
    print(f"  {what} ready at {base_url} (log {log_path})", flush=True)


@contextmanager
def start_server(
    model_dir: str,
    served_name: str,
    threads: int,
    extra_args: list[str],
    log_dir: Path,
    ready_timeout_s: float = 600.0,
    env_overrides: dict[str, str] | None = None,
) -> Iterator[Server]:
    """Yields the running server; stops it with SIGTERM (then SIGKILL) on the way out."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "goodput_runtime",
        "--model",
        model_dir,
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--log-level",
        "warning",
        *extra_args,
    ]
    # torch reads these at start: the server computes on as many threads as the baselines
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **(env_overrides or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "runtime"), env.get("PYTHONPATH")]))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.log"
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            wait_ready(proc, base_url, ready_timeout_s, "server", log_path, every=0.5)
            yield Server(base_url, proc.pid)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@contextmanager
def gateway_process(
    static: str, log_dir: Path, name: str, *args: str, ready_seconds: float = 30, stop_seconds: float = 10
) -> Iterator[tuple[str, int]]:
    """A gateway process serving --static-model `static` (plus `args`) on a loopback port: its URL and pid,
    once /health answers; its log goes to `log_dir`/gateway-`name`-HHMMSS.log."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("gateway", "operator", "contract"))}
    log = (log_dir / f"gateway-{name}-{time.strftime('%H%M%S')}.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "goodput_gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--static-model",
            static,
            *args,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + ready_seconds
        while not healthy(f"http://127.0.0.1:{port}/health"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start; see {log.name}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(stop_seconds)
        log.close()


def machine(load_before: list[float] | tuple[float, ...], load_after: list[float] | tuple[float, ...]) -> dict:
    """What a benchmark's JSON records of the machine it ran on."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "loadavg_before": load_before,
        "loadavg_after": load_after,
    }
