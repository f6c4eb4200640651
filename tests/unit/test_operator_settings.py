"""Operator settings: environment first, flags over it."""

from goodput_operator.__main__ import parse_args
from goodput_operator.settings import DEFAULT_RUNTIME_IMAGE, Settings


def test_defaults_watch_every_namespace_with_the_published_runtime_image():
    settings = Settings.from_env({})
    assert settings.namespace is None
    assert settings.runtime_image == DEFAULT_RUNTIME_IMAGE
    assert settings.hf_endpoint == "https://huggingface.co"
    assert (settings.liveness_port, settings.metrics_port) == (8080, 8081)


def test_environment_sets_namespace_image_and_hub():
    settings = Settings.from_env(
        {
            "WATCH_NAMESPACE": "team-a",
            "RUNTIME_IMAGE": "reg/rt:1",
            "HF_ENDPOINT": "https://hf-mirror.example/",
            "METRICS_PORT": "0",
        }
    )
    assert settings.namespace == "team-a"
    assert settings.runtime_image == "reg/rt:1"
    assert settings.hf_endpoint == "https://hf-mirror.example"
    assert settings.metrics_port == 0


def test_flags_override_the_environment():
    defaults = Settings.from_env({"WATCH_NAMESPACE": "team-a"})
    args = parse_args(["--namespace", "team-b", "--runtime-image", "reg/rt:2", "--liveness-port", "0"], defaults)
    assert (args.namespace, args.runtime_image, args.liveness_port) == ("team-b", "reg/rt:2", 0)
    assert parse_args([], defaults).namespace == "team-a"
