"""Why a service's runtime pods do not serve, read from their status as the kubelet and scheduler wrote it.

No API calls and no clock: `failure(pods)` takes the pods as listed and returns the one
problem worth telling the user about (the most severe, then the first pod by name), or
None when nothing is wrong beyond pods still starting.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from goodput_operator.k8s import parse_timestamp

RUNTIME_FAILING = "RuntimeFailing"
CONTAINER_CONFIG_ERROR = "ContainerConfigError"
IMAGE_PULL_FAILED = "ImagePullFailed"
UNSCHEDULABLE = "Unschedulable"
SEVERITY = (RUNTIME_FAILING, CONTAINER_CONFIG_ERROR, IMAGE_PULL_FAILED, UNSCHEDULABLE)

IMAGE_REASONS = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "RegistryUnavailable"}
)
CONFIG_REASONS = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
MAX_DETAIL = 300


@dataclass(frozen=True)
class Failure:
    reason: str  # CamelCase, one of SEVERITY
    message: str  # what the user reads: "pod <name>: <what happened>"
    detail: tuple[str, ...]  # parts of the message that identify the failure: no pod name, no restart count

    @property
    def key(self) -> tuple[str, ...]:
        """Equal for the same failure on another pod or after another restart: one Event per key."""
        return (self.reason, *self.detail)


def failure(pods: Iterable[dict[str, Any]]) -> Failure | None:
    pods = list(pods)
    serving_groups = _serving_groups(pods)
    found = [f for pod in pods if (f := _pod_failure(pod, _in_serving_group(pod, serving_groups))) is not None]
    if not found:
        return None
    return min(found, key=lambda f: (SEVERITY.index(f.reason), f.message))


def _serving_groups(pods: list[dict[str, Any]]) -> set[str]:
    """The groups of a replica spanning pods whose leader is Ready, named as their workers' names begin: a
    StatefulSet's <name>-runtime-<i> (leader <group>-0), a LeaderWorkerSet's leader's own name (workers
    <leader>-1, ...). A leader turns ready only once every worker of its group has joined and loaded."""
    groups = set()
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "")
        conditions = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or ()}
        if conditions.get("Ready") == "True":
            groups.add(name)
            if name.endswith("-0"):
                groups.add(name[:-2])
    return groups


def _in_serving_group(pod: dict[str, Any], serving_groups: set[str]) -> bool:
    """A worker pod (-1, -2, ...) of a group whose leader is Ready. A worker is never Ready itself (its
    readiness probe keeps it out of the Service's endpoints), so readiness cannot tell it recovered."""
    group, _, ordinal = (pod.get("metadata") or {}).get("name", "").rpartition("-")
    return ordinal.isdigit() and ordinal != "0" and group in serving_groups


def _pod_failure(pod: dict[str, Any], serving_worker: bool = False) -> Failure | None:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
        return None  # going away, or evicted: not what the service runs now
    name = meta.get("name", "?")
    conditions = {c.get("type"): c for c in status.get("conditions") or ()}
    found = []
    least = _least_ready_then_unready(pod)
    for container in [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]:
        ready = conditions.get("ContainersReady") or {}
        f = _container_failure(name, container, ready, serving_worker, least.get(container.get("name", "?"), 0))
        if f is not None:
            found.append(f)
    scheduled = conditions.get("PodScheduled") or {}
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        text = one_line(scheduled.get("message") or "no node fits")
        found.append(Failure(UNSCHEDULABLE, f"pod {name}: cannot be scheduled: {text}", (text,)))
    return min(found, key=lambda f: SEVERITY.index(f.reason)) if found else None


def _least_ready_then_unready(pod: dict[str, Any]) -> dict[str, float]:
    """Per container, the fewest seconds after a start in which its readiness probe can turn it Ready and
    then not: the initial delay, then failureThreshold periods after the first success (the API's defaults
    where the spec leaves them out)."""
    least = {}
    for container in (pod.get("spec") or {}).get("containers") or ():
        probe = container.get("readinessProbe")
        if probe:
            period, threshold = probe.get("periodSeconds", 10), probe.get("failureThreshold", 3)
            least[container.get("name", "?")] = probe.get("initialDelaySeconds", 0) + period * threshold
    return least


def _seconds_between(earlier: str, later: str) -> float | None:
    try:
        return (parse_timestamp(later) - parse_timestamp(earlier)).total_seconds()
    except ValueError:
        return None


def _container_failure(
    pod: str,
    container: dict[str, Any],
    containers_ready: dict[str, Any],
    serving_worker: bool = False,
    least_ready_then_unready: float = 0,
) -> Failure | None:
    name = container.get("name", "?")
    state = container.get("state") or {}
    waiting = state.get("waiting") or {}
    reason = waiting.get("reason") or ""
    if reason in IMAGE_REASONS:
        image = container.get("image") or "?"
        text = one_line(waiting.get("message") or reason)
        return Failure(IMAGE_PULL_FAILED, f"pod {pod}: cannot pull image {image} ({reason}): {text}", (image,))
    if reason in CONFIG_REASONS:
        text = one_line(waiting.get("message") or reason)
        return Failure(CONTAINER_CONFIG_ERROR, f"pod {pod}: {name} cannot start ({reason}): {text}", (name, text))

    terminated = state.get("terminated")
    last = (container.get("lastState") or {}).get("terminated")
    if terminated and terminated.get("exitCode", 0) != 0:
        return _exited(pod, name, terminated, container.get("restartCount", 0))
    if reason == "CrashLoopBackOff" and last:
        return _exited(pod, name, last, container.get("restartCount", 0))
    running = state.get("running")
    if (
        running is not None
        and last
        and last.get("exitCode", 0) != 0
        and not container.get("ready")
        and not serving_worker
    ):
        # Restarted after a crash and not ready since: still the crash loop, between two exits.
        # Ready once since this start (ContainersReady turned False after it) is a different story. The
        # kubelet may record the crash's own turn to False a few seconds after the restart, so a turn
        # sooner after the start than the readiness probe can go Ready and back is still the crash's. A
        # worker of a group is never ready: it recovered once its group's leader is ready again.
        since = containers_ready.get("lastTransitionTime") or ""
        started = running.get("startedAt") or ""
        after = _seconds_between(started, since) if since and started else None
        if after is None or after <= least_ready_then_unready:
            return _exited(pod, name, last, container.get("restartCount", 0))
    return None


def _exited(pod: str, container: str, terminated: dict[str, Any], restarts: int) -> Failure:
    code = terminated.get("exitCode", 0)
    why = terminated.get("reason") or ""
    text = one_line(terminated.get("message") or "")
    shown = why if why not in ("Error", "Completed") else ""  # OOMKilled, ContainerCannotRun, ...
    counts = f"{restarts} restart" + ("" if restarts == 1 else "s")
    exited = f"{container} exited {code}"
    message = f"pod {pod}: {exited} ({shown + ', ' if shown else ''}{counts})" + (f": {text}" if text else "")
    return Failure(RUNTIME_FAILING, message, tuple(part for part in (exited, shown, text) if part))


def one_line(text: str) -> str:
    """The line that says what went wrong: a termination message, or the last words of a log tail.

    With FallbackToLogsOnError the message may be the log's tail: skip traceback frames
    (indented) and headers and keep the last line, which names the exception.
    """
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) <= 2 and not any(line.startswith((" ", "\t", "Traceback")) for line in lines):
        kept = " ".join(line.strip() for line in lines)
    else:
        plain = [line for line in lines if not line.startswith((" ", "\t", "Traceback"))]
        kept = (plain or lines or [""])[-1].strip()
    return kept if len(kept) <= MAX_DETAIL else kept[: MAX_DETAIL - 1] + "…"
