"""``--termination-message-path``: when the runtime cannot serve, Kubernetes shows why (``kubectl
describe pod``: Last State: Terminated, Message), read from a file the kubelet mounts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from goodput_runtime.__main__ import TERMINATION_MESSAGE_PATH, parse_args, write_termination_message


def run_cli(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "goodput_runtime", "--host", "127.0.0.1", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_missing_model_directory_is_the_termination_message(tmp_path: Path) -> None:
    message = tmp_path / "termination-log"  # a new file in an existing directory
    result = run_cli("--model", "/nonexistent/model", "--termination-message-path", str(message))
    assert result.returncode == 1
    assert message.read_text() == (
        "Cannot serve /nonexistent/model: model directory /nonexistent/model does not exist\n"
    )


def test_an_unsupported_architecture_is_the_termination_message(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "mamba"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForCausalLM"]}))
    message = tmp_path / "termination-log"
    message.write_text("")  # as the kubelet mounts it: an existing, empty file
    result = run_cli("--model", str(model), "--device", "cpu", "--termination-message-path", str(message))
    assert result.returncode == 1
    reason = message.read_text()
    assert reason.startswith(f"Cannot serve {model}: unsupported architecture MambaForCausalLM in ")
    assert reason.count("\n") == 1 and reason in result.stderr


def test_a_refused_flag_is_the_termination_message(tmp_path: Path) -> None:
    message = tmp_path / "termination-log"
    result = run_cli("--model", "m", "--port", "70000", f"--termination-message-path={message}")
    assert result.returncode == 2
    assert message.read_text() == "Invalid arguments: argument --port: not a TCP port: '70000'\n"


def test_the_default_path_creates_nothing_in_dev_outside_kubernetes() -> None:
    if Path(TERMINATION_MESSAGE_PATH).exists():
        pytest.skip("running in a container that has a termination log")
    assert parse_args(["--model", "m"]).termination_message_path == TERMINATION_MESSAGE_PATH
    result = run_cli("--model", "/nonexistent/model")
    assert result.returncode == 1
    assert not Path(TERMINATION_MESSAGE_PATH).exists()


def test_writing_the_message_never_fails_and_keeps_it_to_one_short_line(tmp_path: Path) -> None:
    write_termination_message(str(tmp_path / "no-such-dir" / "log"), "reason")
    assert not (tmp_path / "no-such-dir").exists()
    write_termination_message(str(tmp_path), "a directory is no place for it")  # no exception
    write_termination_message("/dev/goodput-termination-test", "never in /dev unless it exists")
    assert not Path("/dev/goodput-termination-test").exists()
    message = tmp_path / "log"
    write_termination_message(str(message), "first line\nsecond line " + "x" * 10_000)
    text = message.read_text()
    assert text.startswith("first line second line x") and text.count("\n") == 1
    assert len(text.encode()) < 4096
