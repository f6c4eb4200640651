"""The command line: every flag reaches the engine config, bad values are refused with a reason."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from goodput_runtime.__main__ import byte_size, engine_config, parse_args


def run_cli(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "goodput_runtime", *flags], capture_output=True, text=True, timeout=60)


def test_defaults_serve_the_model_under_its_own_name() -> None:
    args = parse_args(["--model", "Qwen/Qwen2.5-0.5B-Instruct"])
    config = engine_config(args)
    assert config.model_name == "Qwen/Qwen2.5-0.5B-Instruct"
    assert (args.host, args.port, args.shutdown_grace) == ("0.0.0.0", 8000, 30.0)
    assert (args.shutdown_delay, args.termination_message_path) == (0.0, "/dev/termination-log")
    assert config.enable_prefix_caching is True
    assert args.slo_ttft is None and args.slo_tpot is None


def test_every_engine_flag_reaches_the_config() -> None:
    args = parse_args(
        [
            "--model",
            "/models/m",
            "--served-model-name",
            "chat",
            "--revision",
            "v2",
            "--dtype",
            "bfloat16",
            "--device",
            "cpu",
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--block-size",
            "32",
            "--kv-cache-memory",
            "512Mi",
            "--gpu-memory-utilization",
            "0.8",
            "--no-enable-prefix-caching",
            "--max-queue",
            "7",
            "--seed",
            "42",
            "--slo-ttft",
            "500ms",
            "--slo-tpot",
            "0.05",
            "--shutdown-grace",
            "10",
            "--port",
            "9000",
            "--host",
            "127.0.0.1",
            "--log-level",
            "debug",
            "--tensor-parallel-size",
            "1",
            "--quantization",
            "none",
            "--shutdown-delay",
            "5",
            "--termination-message-path",
            "/tmp/why",
        ]
    )
    config = engine_config(args)
    assert (config.model, config.served_model_name, config.model_name) == ("/models/m", "chat", "chat")
    assert (config.revision, config.dtype, config.device) == ("v2", "bfloat16", "cpu")
    assert (config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens) == (4096, 8, 512)
    assert (config.block_size, config.kv_cache_memory) == (32, 512 * 2**20)
    assert (config.gpu_memory_utilization, config.enable_prefix_caching) == (0.8, False)
    assert (config.max_queue, config.seed) == (7, 42)
    assert (args.slo_ttft, args.slo_tpot, args.shutdown_grace) == (0.5, 0.05, 10.0)
    assert (args.host, args.port, args.log_level) == ("127.0.0.1", 9000, "debug")
    assert (args.shutdown_delay, args.termination_message_path) == (5.0, "/tmp/why")


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1048576", 1048576),
        ("512Mi", 512 * 2**20),
        ("2Gi", 2 * 2**30),
        ("1.5Gi", 3 * 2**29),
        ("1G", 10**9),
        ("64k", 64_000),
        ("100Ki", 102_400),
    ],
)
def test_kv_cache_memory_takes_kubernetes_quantities(text: str, size: int) -> None:
    assert byte_size(text) == size


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (["--tensor-parallel-size", "0"], "must be at least 1"),
        (["--quantization", "awq"], "invalid choice"),
        (["--kv-cache-memory", "lots"], "not a size in bytes"),
        (["--kv-cache-memory", "0"], "at least one byte"),
        (["--max-num-seqs", "0"], "must be at least 1"),
        (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["--slo-ttft", "-1"], "not a duration"),
        (["--slo-tpot", "0"], "greater than zero"),
        (["--port", "70000"], "not a TCP port"),
        (["--shutdown-delay", "soon"], "not a duration"),
        (["--dtype", "int4"], "invalid choice"),
    ],
)
def test_bad_flags_exit_2_with_a_reason(flags: list[str], complaint: str, capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        parse_args(["--model", "m", *flags])
    assert caught.value.code == 2
    assert complaint in capsys.readouterr().err


def test_a_tensor_parallel_size_the_heads_do_not_divide_is_refused_before_any_rank_starts(tiny_model_dir) -> None:
    result = run_cli(
        "--model", str(tiny_model_dir), "--tensor-parallel-size", "4", "--host", "127.0.0.1", "--port", "0"
    )
    assert result.returncode == 1
    assert "KV heads (2) is not divisible by --tensor-parallel-size 4" in result.stderr
    assert "Traceback" not in result.stderr


def test_fp8_on_a_machine_without_a_capable_gpu_is_refused_naming_the_requirement(tiny_model_dir) -> None:
    result = run_cli("--model", str(tiny_model_dir), "--quantization", "fp8", "--host", "127.0.0.1", "--port", "0")
    assert result.returncode == 1
    assert "compute capability 8.9" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_lists_every_flag() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for flag in (
        "--model",
        "--served-model-name",
        "--revision",
        "--host",
        "--port",
        "--dtype",
        "--device",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--kv-cache-memory",
        "--gpu-memory-utilization",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--max-queue",
        "--slo-ttft",
        "--slo-tpot",
        "--shutdown-grace",
        "--shutdown-delay",
        "--termination-message-path",
        "--seed",
        "--log-level",
        "--tensor-parallel-size",
        "--quantization",
        "--quantize-lm-head",
    ):
        assert flag in result.stdout


def test_missing_model_directory_exits_1_naming_it() -> None:
    result = run_cli("--model", "/nonexistent/model", "--host", "127.0.0.1", "--port", "0")
    assert result.returncode == 1
    assert "Cannot serve /nonexistent/model: model directory /nonexistent/model does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_port_in_use_exits_1_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--model", "/nonexistent/model", "--host", "127.0.0.1", "--port", str(port))
    assert result.returncode == 1
    assert f"Cannot listen on 127.0.0.1:{port}" in result.stderr
