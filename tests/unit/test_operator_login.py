"""How the operator finds the API server from inside a pod."""

from __future__ import annotations

import pytest

from goodput_operator.handlers import in_cluster_server


def test_the_service_environment_wins_over_the_dns_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # clusters without DNS (and client-go itself) reach the API through these variables
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert in_cluster_server("https://kubernetes.default.svc") == "https://10.0.0.1:443"


def test_an_ipv6_service_host_is_bracketed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    assert in_cluster_server("https://kubernetes.default.svc") == "https://[fd00::1]:6443"


def test_without_the_variables_the_default_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    assert in_cluster_server("https://kubernetes.default.svc") == "https://kubernetes.default.svc"
