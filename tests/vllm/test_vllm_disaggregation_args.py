"""The vllm tier: a disaggregated InferenceService's vLLM command lines (both roles) parse in vLLM's own
parser, and its --kv-transfer-config becomes the NIXL connector's KVTransferConfig. The hand-off itself
needs NIXL on a GPU, which this machine does not have; only the flags are checked here."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from goodput_contract.api.spec import parse
from goodput_operator import builders, engines, roles
from goodput_operator.settings import Settings

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys
from vllm.config.kv_transfer import KVTransferConfig
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
ns = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
validate_parsed_serve_args(ns)
config = ns.kv_transfer_config
if isinstance(config, str):
    config = KVTransferConfig(**json.loads(config))
elif isinstance(config, dict):
    config = KVTransferConfig(**config)
print(json.dumps({
    "tensor_parallel_size": ns.tensor_parallel_size,
    "kv_connector": config.kv_connector,
    "kv_role": config.kv_role,
    "is_kv_producer": config.is_kv_producer,
    "is_kv_consumer": config.is_kv_consumer,
    "kv_load_failure_policy": config.kv_load_failure_policy,
}))
"""


def vllm_python() -> str:
    """The cached venv's python (hack/vllm-venv.sh builds it once; `make test` beforehand)."""
    out = subprocess.run([str(ROOT / "hack" / "vllm-venv.sh")], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        pytest.fail(f"hack/vllm-venv.sh failed: {out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def test_both_roles_parse_in_vllms_parser():
    svc = parse(
        "chat",
        "ns",
        {
            "model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": "smollm2"},
            "engine": {"kind": "vllm", "extraArgs": ["--enforce-eager"]},
            "resources": {"gpu": 1},
            "disaggregation": {
                "prefill": {"minReplicas": 1, "maxReplicas": 2, "tensor": 1},
                "decode": {"minReplicas": 1, "maxReplicas": 4, "tensor": 1},
            },
        },
    )
    engines.validate(svc)
    owner = builders.owner_reference("chat", "uid")
    settings = Settings(runtime_image="registry.local/goodput-runtime:test")
    python = vllm_python()
    seen = {}
    for role, (deployment, _) in (
        (roles.PREFILL, roles.build_prefill(svc, settings, owner)),
        (roles.DECODE, roles.build_decode(svc, settings, owner)),
    ):
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        out = subprocess.run(
            [python, "-c", PROBE, *args],
            capture_output=True,
            text=True,
            timeout=300,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        assert out.returncode == 0, out.stderr[-3000:]
        seen[role] = json.loads(out.stdout.strip().splitlines()[-1])
    for role in roles.ROLES:  # vLLM's P/D: both sides kv_both; each request's kv_transfer_params picks the side
        assert seen[role]["kv_connector"] == "NixlConnector" and seen[role]["kv_role"] == "kv_both"
        assert seen[role]["is_kv_producer"] and seen[role]["is_kv_consumer"]
        assert seen[role]["tensor_parallel_size"] == 1
    # a decode side that cannot load the blocks recomputes the prompt, as the goodput runtime's default does
    assert seen[roles.DECODE]["kv_load_failure_policy"] == "recompute"
