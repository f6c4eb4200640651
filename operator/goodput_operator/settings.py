"""Operator settings, read once at start-up from flags and the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_RUNTIME_IMAGE = "ghcr.io/goodput-dev/goodput-runtime:0.1.0"
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
# Other engines' official images, pinned by tag (engines.py holds the flags checked against these versions)
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
DEFAULT_VLLM_CPU_IMAGE = "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"
DEFAULT_SGLANG_IMAGE = "lmsysorg/sglang:v0.5.5"


@dataclass(frozen=True)
class Settings:
    runtime_image: str = DEFAULT_RUNTIME_IMAGE
    vllm_image: str = DEFAULT_VLLM_IMAGE  # engine.kind vllm on GPUs
    vllm_cpu_image: str = DEFAULT_VLLM_CPU_IMAGE  # engine.kind vllm with resources.gpu 0
    sglang_image: str = DEFAULT_SGLANG_IMAGE
    image_pull_policy: str = "IfNotPresent"
    field_manager: str = "goodput-operator"
    namespace: str | None = None  # None: every namespace
    liveness_port: int = 8080
    metrics_port: int = 8081  # 0: no metrics endpoint
    resync_seconds: float = 30.0
    lora_resync_seconds: float = 15.0  # how often LoraAdapters are checked on their replicas (restarts, new ones)
    discovery_seconds: float = 60.0  # how long optional APIs (PDB version, monitors) stay cached
    hf_endpoint: str = DEFAULT_HF_ENDPOINT
    hub_timeout_seconds: float = 10.0
    autoscaler_period_seconds: float = 15.0  # the goodput control loop's period
    autoscaler_window_seconds: float = 60.0  # short window for rates and attainment; the long one is 5×
    autoscaler_dispersion: bool = True  # plan headroom with the arrivals' measured dispersion (False: as for Poisson)
    prometheus_url: str | None = None  # None: the autoscaler scrapes the pods itself
    gateway_namespace: str = "goodput-system"  # where the goodput-gateway Service's pods are found
    gateway_urls: tuple[str, ...] = ()  # or these gateway URLs instead
    monitoring_namespace: str = "monitoring"  # Prometheus's, admitted by the runtime pods' NetworkPolicy

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        return cls(
            runtime_image=env.get("RUNTIME_IMAGE") or DEFAULT_RUNTIME_IMAGE,
            vllm_image=env.get("VLLM_IMAGE") or DEFAULT_VLLM_IMAGE,
            vllm_cpu_image=env.get("VLLM_CPU_IMAGE") or DEFAULT_VLLM_CPU_IMAGE,
            sglang_image=env.get("SGLANG_IMAGE") or DEFAULT_SGLANG_IMAGE,
            image_pull_policy=env.get("RUNTIME_IMAGE_PULL_POLICY") or "IfNotPresent",
            namespace=env.get("WATCH_NAMESPACE") or None,
            liveness_port=int(env.get("LIVENESS_PORT", "8080")),
            metrics_port=int(env.get("METRICS_PORT", "8081")),
            resync_seconds=float(env.get("RESYNC_SECONDS", "30")),
            lora_resync_seconds=float(env.get("LORA_RESYNC_SECONDS", "15")),
            discovery_seconds=float(env.get("DISCOVERY_SECONDS", "60")),
            hf_endpoint=(env.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/"),
            hub_timeout_seconds=float(env.get("HUB_TIMEOUT_SECONDS", "10")),
            autoscaler_period_seconds=float(env.get("AUTOSCALER_PERIOD_SECONDS", "15")),
            autoscaler_window_seconds=float(env.get("AUTOSCALER_WINDOW_SECONDS", "60")),
            autoscaler_dispersion=_on_off("AUTOSCALER_DISPERSION", env.get("AUTOSCALER_DISPERSION") or "on"),
            prometheus_url=(env.get("PROMETHEUS_URL") or "").rstrip("/") or None,
            gateway_namespace=env.get("GATEWAY_NAMESPACE") or env.get("POD_NAMESPACE") or "goodput-system",
            gateway_urls=tuple(u for u in (env.get("GATEWAY_URL") or "").split(",") if u),
            monitoring_namespace=env.get("MONITORING_NAMESPACE") or "monitoring",
        )


def _on_off(name: str, value: str) -> bool:
    if value not in ("on", "off"):
        raise ValueError(f"{name} must be on or off, got {value!r}")
    return value == "on"
