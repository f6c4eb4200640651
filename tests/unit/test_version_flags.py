"""The version a user can ask a running component for: `--version` on the command line, and the
`*_build_info` series on its /metrics, both the one VERSION of goodput_contract/version.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client import REGISTRY, generate_latest

from goodput_contract.version import VERSION


@pytest.mark.parametrize(
    ("module", "name"), [("goodput_operator", "goodput-operator"), ("goodput_gateway", "goodput-gateway")]
)
def test_version_flag_prints_the_release(module, name):
    done = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{name} {VERSION}"


def test_the_operators_metrics_carry_its_version():
    import goodput_operator.metrics  # noqa: F401  (registers the series)

    text = generate_latest(REGISTRY).decode()
    assert f'goodput_operator_build_info{{version="{VERSION}"}} 1.0' in text


def test_the_gateways_metrics_carry_its_version():
    from goodput_gateway.metrics import GatewayMetrics

    text = generate_latest(GatewayMetrics().registry).decode()
    assert f'goodput_gateway_build_info{{version="{VERSION}"}} 1.0' in text
