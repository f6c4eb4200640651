"""The restricted Pod Security Standard (Kubernetes' own rules, baseline included) as a checker.

`violations(pod_spec)` lists, in words, every rule of the profile a pod spec breaks; an empty
list means the API server's `pod-security.kubernetes.io/enforce: restricted` admits it. One more
rule of this project rides along: a read-only root filesystem in every container.
"""

from __future__ import annotations

from typing import Any

RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SECCOMP_ALLOWED = {"RuntimeDefault", "Localhost"}


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", ()), *pod.get("containers", ()), *pod.get("ephemeralContainers", ())]


def violations(pod: dict[str, Any], read_only_root: bool = True) -> list[str]:
    found: list[str] = []
    pod_ctx = pod.get("securityContext") or {}
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(host):
            found.append(f"{host} is true")
    if (pod_ctx.get("windowsOptions") or {}).get("hostProcess"):
        found.append("pod windowsOptions.hostProcess")
    for volume in pod.get("volumes", ()):
        kinds = set(volume) - {"name"}
        if kinds - RESTRICTED_VOLUMES:
            found.append(f"volume {volume.get('name')}: {sorted(kinds - RESTRICTED_VOLUMES)} not allowed")
    for sysctl in pod_ctx.get("sysctls", ()):
        if sysctl.get("name") not in SAFE_SYSCTLS:
            found.append(f"sysctl {sysctl.get('name')}")
    if pod_ctx.get("runAsUser") == 0:
        found.append("pod runAsUser 0")
    pod_seccomp = (pod_ctx.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_ALLOWED:
        found.append(f"pod seccompProfile {pod_seccomp}")
    if (pod_ctx.get("seLinuxOptions") or {}).get("user") or (pod_ctx.get("seLinuxOptions") or {}).get("role"):
        found.append("pod seLinuxOptions user/role")
    for c in containers(pod):
        name, ctx = c.get("name"), c.get("securityContext") or {}
        if ctx.get("privileged"):
            found.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or ()):
            found.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add") or ()) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds capabilities {caps.get('add')}")
        non_root = ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot"))
        if non_root is not True:
            found.append(f"{name}: runAsNonRoot is not true")
        if ctx.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (ctx.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in SECCOMP_ALLOWED:
            found.append(f"{name}: seccompProfile is {seccomp}, not RuntimeDefault or Localhost")
        if ctx.get("procMount") not in (None, "Default"):
            found.append(f"{name}: procMount {ctx.get('procMount')}")
        if any(p.get("hostPort") for p in c.get("ports", ())):
            found.append(f"{name}: hostPort")
        if (ctx.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"{name}: windowsOptions.hostProcess")
        if read_only_root and ctx.get("readOnlyRootFilesystem") is not True:
            found.append(f"{name}: readOnlyRootFilesystem is not true")
    return found


def pod_specs(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod specs a manifest makes: a Pod's own, or the template of a workload (CronJob's job's)."""
    kind, spec = manifest.get("kind"), manifest.get("spec") or {}
    if kind == "Pod":
        return [spec]
    if kind == "CronJob":
        return [spec["jobTemplate"]["spec"]["template"]["spec"]]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return [spec["template"]["spec"]]
    return []
