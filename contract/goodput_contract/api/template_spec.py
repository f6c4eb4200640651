"""spec.template: overrides for the runtime pods, with the checks that keep them inside the restricted
Pod Security profile, keep keys out of the spec and give children only names the API server accepts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from goodput_contract.api import names
from goodput_contract.api.errors import SpecError

# Volume types the restricted Pod Security profile admits (besides the name)
RESTRICTED_VOLUME_TYPES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
API_KEY_VARIABLES = frozenset({"GOODPUT_API_KEY", "VLLM_API_KEY"})  # what spec.auth sets; never a literal
# The runtime pod's own volumes and mount paths (builders.py), which template.volumes must not reuse
RESERVED_VOLUMES = frozenset({"model-cache", "tmp", "model-source", "dshm", "model-node-cache", "kv-offload"})
RESERVED_MOUNT_PATHS = frozenset(
    {"/var/cache/goodput", "/tmp", "/mnt/models", "/dev/shm", "/mnt/node-cache", "/var/cache/goodput-kv-offload"}
)


@dataclass(frozen=True)
class PodTemplate:
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = None
    service_account_name: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    env: tuple[dict[str, Any], ...] = ()
    volumes: tuple[dict[str, Any], ...] = ()
    volume_mounts: tuple[dict[str, Any], ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


def _check(field_path: str, problem: str | None) -> None:
    if problem:
        raise SpecError(field_path, problem, reason="InvalidName")


def _check_secret_ref(field_path: str, raw: dict[str, Any] | None) -> None:
    if raw:
        _check(f"{field_path}.name", names.dns_subdomain(raw["name"]))
        if raw.get("key"):
            _check(f"{field_path}.key", names.secret_key(raw["key"]))


def _check_labels(field_path: str, labels: dict[str, str], values: bool = True) -> None:
    for key, value in labels.items():
        _check(f"{field_path}[{key}]", names.qualified_name(key) or (names.label_value(value) if values else None))


def _check_mounts(raw: dict[str, Any]) -> None:
    volumes = [v.get("name", "") for v in raw.get("volumes") or ()]
    for i, name in enumerate(volumes):
        _check(f"template.volumes[{i}].name", names.dns_label(name))
        if name in RESERVED_VOLUMES or name in volumes[:i]:
            raise SpecError(
                f"template.volumes[{i}].name",
                f"{name!r} is taken (the runtime pod's own volumes are {', '.join(sorted(RESERVED_VOLUMES))})",
                reason="VolumeNameTaken",
            )
    paths: list[str] = []
    for i, mount in enumerate(raw.get("volumeMounts") or ()):
        if mount["name"] not in volumes:
            raise SpecError(
                f"template.volumeMounts[{i}].name",
                f"{mount['name']!r} is not one of template.volumes",
                reason="VolumeNotFound",
            )
        path = str(mount["mountPath"]).rstrip("/") or "/"
        if not path.startswith("/") or ":" in path or path in RESERVED_MOUNT_PATHS or path in paths:
            raise SpecError(
                f"template.volumeMounts[{i}].mountPath",
                f"{mount['mountPath']!r} must be an absolute path, used once, and none of the runtime's "
                f"own ({', '.join(sorted(RESERVED_MOUNT_PATHS))})",
                reason="MountPathTaken",
            )
        paths.append(path)


def _check_template(raw: dict[str, Any]) -> None:
    """What would take the pods out of the restricted Pod Security profile, put a key in the CR, or
    build a pod the API server refuses."""
    for i, volume in enumerate(raw.get("volumes") or ()):
        kinds = set(volume) - {"name"}
        if kinds - RESTRICTED_VOLUME_TYPES:
            raise SpecError(
                f"template.volumes[{i}]",
                f"{', '.join(sorted(kinds - RESTRICTED_VOLUME_TYPES))} volumes break the restricted Pod "
                f"Security profile; use one of {', '.join(sorted(RESTRICTED_VOLUME_TYPES))}",
                reason="VolumeTypeNotAllowed",
            )
    for i, var in enumerate(raw.get("env") or ()):
        if var.get("name") in API_KEY_VARIABLES:
            raise SpecError(
                f"template.env[{i}]",
                f"sets {var['name']}, which spec.auth.apiKeySecretRef sets from a "
                "Secret (a key in the spec would be readable by anyone who can read the spec)",
                reason="APIKeyInSpec",
            )
        _check(f"template.env[{i}].name", names.env_name(str(var.get("name"))))
    _check_mounts(raw)
    _check_labels("template.nodeSelector", raw.get("nodeSelector") or {})
    _check_labels("template.labels", raw.get("labels") or {})
    _check_labels("template.annotations", raw.get("annotations") or {}, values=False)
    for field_name in ("priorityClassName", "serviceAccountName"):
        if raw.get(field_name):
            _check(f"template.{field_name}", names.dns_subdomain(raw[field_name]))
    for i, secret in enumerate(raw.get("imagePullSecrets") or ()):
        _check(f"template.imagePullSecrets[{i}].name", names.dns_subdomain(secret["name"]))


def _template(raw: dict[str, Any]) -> PodTemplate:
    _check_template(raw)
    return PodTemplate(
        node_selector=dict(raw.get("nodeSelector") or {}),
        tolerations=tuple(raw.get("tolerations") or ()),
        affinity=raw.get("affinity"),
        priority_class_name=raw.get("priorityClassName"),
        service_account_name=raw.get("serviceAccountName"),
        image_pull_secrets=tuple(s["name"] for s in raw.get("imagePullSecrets") or ()),
        env=tuple(raw.get("env") or ()),
        volumes=tuple(raw.get("volumes") or ()),
        volume_mounts=tuple(raw.get("volumeMounts") or ()),
        labels=dict(raw.get("labels") or {}),
        annotations=dict(raw.get("annotations") or {}),
    )
