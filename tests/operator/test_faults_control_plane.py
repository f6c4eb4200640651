"""Faults on the control plane, injected for real: the operator SIGKILLed mid-reconcile, the API
server and etcd restarted while a user creates and scales services.

The control plane is the tier's own (hack/cluster.sh: etcd, kube-apiserver,
kube-controller-manager), the operator the module's `python -m goodput_operator` process.
Components are killed with SIGKILL and started again with their own command line
(`hack/cluster.sh restart`). A user's client keeps writing through each fault; every write it
sends is retried until the API server takes it, and each failed attempt must be a clear error
(connection refused, a timeout, a 5xx), never a 4xx that would blame the request. Afterwards
every service converges: one Deployment and one Service each, at the replicas asked for,
status caught up with the spec's generation; none duplicated, none lost.

Each test prints one `FAULT-ROW {json}` line, which bench/faults.py collects into its table.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import urllib3
from harness import GROUP, PLURAL, ROOT, VERSION, Cluster, OperatorProcess, wait_for
from kubernetes.client.exceptions import ApiException

pytestmark = [pytest.mark.faults, pytest.mark.slow]

COUNT = 20
CONVERGE_SECONDS = 180
WRITE_TIMEOUT = 5  # seconds a user's call waits before it counts as failed
CLEAR_STATUSES = {500, 503, 504}


def spec(i: int, replicas: int) -> dict[str, Any]:
    return {"model": {"source": f"file:///models/m{i}"}, "resources": {"gpu": 0, "memory": "1Gi"}, "replicas": replicas}


def restart(cluster: Cluster, component: str, pause: float) -> None:
    subprocess.run(
        [
            str(ROOT / "hack" / "cluster.sh"),
            "restart",
            component,
            "--signal",
            "KILL",
            "--pause",
            str(pause),
            "--dir",
            str(cluster.dir),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )


def control_plane_up(cluster: Cluster) -> float:
    """Every component the cluster started is alive again and the API server answers /readyz;
    returns the seconds that took."""
    started = time.monotonic()
    wait_for(
        lambda: cluster.kubectl("get", "--raw", "/readyz", check=False).returncode == 0,
        120,
        "the API server to be ready again",
    )
    env = subprocess.run(
        [str(ROOT / "hack" / "cluster.sh"), "env", "--dir", str(cluster.dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert env.returncode == 0, f"a control-plane component died after the fault: {env.stderr}"
    return time.monotonic() - started


class User:
    """A user's writes through a fault: each sent again until the API server takes it.

    `sent` counts every attempt, `errors` keeps what each failed one saw, `retried` counts the
    writes that needed more than one attempt. A create whose earlier attempt landed although its
    answer was lost comes back 409 AlreadyExists on the retry: that write is done.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.sent = 0
        self.errors: list[str] = []
        self.retried = 0
        self.done = 0

    def write(self, call: Callable[[], Any], create: bool = False, give_up: float = 120) -> None:
        deadline = time.monotonic() + give_up
        attempts = 0
        while True:
            attempts += 1
            self.sent += 1
            try:
                call()
                break
            except ApiException as err:
                if create and attempts > 1 and err.status == 409:
                    break
                assert err.status in CLEAR_STATUSES, f"a write failed with {err.status}, blaming the request: {err}"
                self.errors.append(f"HTTP {err.status} {err.reason}")
            except (urllib3.exceptions.HTTPError, OSError) as err:
                self.errors.append(type(err).__name__)
            if attempts == 1:  # failed once: this write is sent again
                self.retried += 1
            assert time.monotonic() < deadline, f"a write kept failing for {give_up}s: {self.errors[-3:]}"
            time.sleep(0.5)
        self.done += 1

    def create(self, namespace: str, name: str, body_spec: dict[str, Any]) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": body_spec,
        }
        self.write(
            lambda: self.cluster.custom.create_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, body, _request_timeout=WRITE_TIMEOUT
            ),
            create=True,
        )

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        self.write(
            lambda: self.cluster.custom.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                {"spec": {"replicas": replicas}},
                _request_timeout=WRITE_TIMEOUT,
            )
        )


def in_background(work: Callable[[], None]) -> Callable[[], None]:
    """Runs `work` in a thread; the returned join() waits for it and re-raises what it raised."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as err:  # handed to the test's thread
            failure.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> None:
        thread.join(300)
        assert not thread.is_alive(), "the user's writes never finished"
        if failure:
            raise failure[0]

    return join


def unconverged(cluster: Cluster, namespace: str, expected: dict[str, int]) -> list[str]:
    """What still differs from `expected` (service name -> replicas); empty once converged.

    Fails at once on a duplicate: two Deployments or Services owned by one service, or a child
    of a service that does not exist.
    """
    items = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
    services = {i["metadata"]["name"]: i for i in items}
    assert set(services) <= set(expected), f"services nobody asked for: {set(services) - set(expected)}"
    owned: dict[tuple[str, str], list[str]] = {}
    for kind, objects in (
        ("Deployment", cluster.apps.list_namespaced_deployment(namespace).items),
        ("Service", cluster.core.list_namespaced_service(namespace).items),
    ):
        for obj in objects:
            owners = [o.name for o in obj.metadata.owner_references or () if o.kind == "InferenceService"]
            assert len(owners) == 1, f"{kind} {obj.metadata.name} has owners {owners}"
            owned.setdefault((kind, owners[0]), []).append(obj.metadata.name)
    duplicates = {k: v for k, v in owned.items() if len(v) > 1}
    assert not duplicates, f"duplicate children: {duplicates}"
    deployments = {d.metadata.name: d for d in cluster.apps.list_namespaced_deployment(namespace).items}
    behind = []
    for name, replicas in expected.items():
        svc = services.get(name)
        if svc is None:
            behind.append(f"{name}: missing")
            continue
        status = svc.get("status") or {}
        valid = next((c for c in status.get("conditions") or () if c["type"] == "Valid"), {})
        deploy = deployments.get(f"{name}-runtime")
        if ("Service", name) not in owned or deploy is None:
            behind.append(f"{name}: children missing")
        elif deploy.spec.replicas != replicas:
            behind.append(f"{name}: Deployment at {deploy.spec.replicas}, asked {replicas}")
        elif status.get("observedGeneration") != svc["metadata"]["generation"] or valid.get("status") != "True":
            behind.append(
                f"{name}: status at generation {status.get('observedGeneration')} of "
                f"{svc['metadata']['generation']}, Valid={valid.get('status')}"
            )
        elif status.get("replicas") != replicas:
            behind.append(f"{name}: status.replicas {status.get('replicas')}, asked {replicas}")
    return behind


def converge(
    cluster: Cluster, namespace: str, expected: dict[str, int], since: float, operator: OperatorProcess
) -> float:
    """Seconds from `since` until every service in `expected` converged; a timeout names what is behind and
    ends with the operator's log."""
    last: list[list[str]] = [[]]

    def done() -> bool:
        last[0] = unconverged(cluster, namespace, expected)
        return not last[0]

    try:
        wait_for(done, CONVERGE_SECONDS, "every service to converge")
    except AssertionError as err:
        alive = "exited"
        if operator.process is not None and operator.process.poll() is None:
            alive = "running; its threads' stacks at the end"
            operator.process.send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack to its log
            time.sleep(1)
        raise AssertionError(
            f"{err}; still behind: {last[0][:10]}; the operator ({alive}) logged:\n{operator.log()[-12000:]}"
        ) from None
    return time.monotonic() - since


def report(fault: str, user: User, converge_s: float, **extra: Any) -> None:
    row = {
        "fault": fault,
        "tier": "apiserver",
        "requests": user.sent,
        "failed": len(user.errors),
        "retried": user.retried,
        "converge_s": round(converge_s, 1),
        "errors": sorted(set(user.errors)),
        **extra,
    }
    print("FAULT-ROW " + json.dumps(row))


def test_operator_killed_mid_reconcile_of_20_services_converges_without_duplicates(cluster, operator, namespace):
    user = User(cluster)
    for i in range(COUNT):
        user.create(namespace, f"svc-{i:02d}", spec(i, 1))

    # SIGKILL as soon as the first Deployment exists: the operator is still working through the rest
    wait_for(lambda: cluster.apps.list_namespaced_deployment(namespace).items, 60, "a first Deployment")
    assert operator.process is not None
    operator.process.kill()
    operator.process.wait()
    expected = {f"svc-{i:02d}": 1 for i in range(COUNT)}
    behind_at_kill = len(unconverged(cluster, namespace, expected))
    assert behind_at_kill > 0, "every service had converged before the kill: the fault came too late"

    # while the operator is down the user scales a quarter of them
    for i in range(0, COUNT, 4):
        user.scale(namespace, f"svc-{i:02d}", 2)
        expected[f"svc-{i:02d}"] = 2
    restarted = time.monotonic()
    operator.start()
    seconds = converge(cluster, namespace, expected, restarted, operator)
    assert not user.errors, user.errors  # the API server was up throughout: no write of the user's failed
    assert "Traceback" not in operator.log(), operator.log()[-4000:]
    report("operator SIGKILL mid-reconcile of 20 services", user, seconds, behind_at_kill=behind_at_kill)


def test_api_server_restart_while_services_are_created_and_scaled(cluster, operator, namespace):
    user = User(cluster)
    expected = {f"svc-{i:02d}": 1 + i % 3 for i in range(COUNT)}

    def work() -> None:
        for i in range(COUNT):
            user.create(namespace, f"svc-{i:02d}", spec(i, 1))
            if i % 3:
                user.scale(namespace, f"svc-{i:02d}", 1 + i % 3)
            time.sleep(0.1)  # a user's pace: the writes span the restart

    join = in_background(work)
    wait_for(lambda: user.done >= 6, 60, "the user's first writes")
    restart(cluster, "kube-apiserver", pause=3)
    restarted = time.monotonic()
    api_back = control_plane_up(cluster)
    join()
    seconds = converge(cluster, namespace, expected, restarted, operator)
    assert user.errors, "no write of the user's met the restart: the fault missed the workload"
    assert operator.process is not None and operator.process.poll() is None, operator.log()[-4000:]
    report(
        "API server restart (SIGKILL, 3 s down) while creating and scaling 20 services",
        user,
        seconds,
        api_ready_s=round(api_back, 1),
    )


def test_etcd_restart_while_services_are_scaled(cluster, operator, namespace):
    user = User(cluster)
    count = 8
    expected = {f"svc-{i:02d}": 1 for i in range(count)}
    for name in expected:
        user.create(namespace, name, spec(int(name[-2:]), 1))
    converge(cluster, namespace, expected, time.monotonic(), operator)

    def work() -> None:
        for round_ in (2, 3):
            for name in expected:
                user.scale(namespace, name, round_)
                time.sleep(0.2)

    join = in_background(work)
    wait_for(lambda: user.done >= count + 3, 60, "the user's first scalings")
    restart(cluster, "etcd", pause=3)
    restarted = time.monotonic()
    api_back = control_plane_up(cluster)
    join()
    expected = dict.fromkeys(expected, 3)
    seconds = converge(cluster, namespace, expected, restarted, operator)
    assert user.errors, "no write of the user's met the restart: the fault missed the workload"
    assert operator.process is not None and operator.process.poll() is None, operator.log()[-4000:]
    report("etcd restart (SIGKILL, 3 s down) while scaling 8 services", user, seconds, api_ready_s=round(api_back, 1))


def test_sigusr1_writes_every_threads_stack_and_the_operator_goes_on(cluster, operator, namespace):
    assert operator.process is not None and operator.process.poll() is None
    before = len(operator.log())
    operator.process.send_signal(signal.SIGUSR1)
    wait_for(lambda: "Current thread" in operator.log()[before:], 10, "the stacks in the operator's log")
    dump = operator.log()[before:]
    assert "Thread 0x" in dump and "goodput_operator" in dump, dump[-3000:]  # the main thread's frames included
    # and it still reconciles
    user = User(cluster)
    user.create(namespace, "after-dump", spec(0, 1))
    wait_for(lambda: not unconverged(cluster, namespace, {"after-dump": 1}), 60, "a service created after the dump")
    assert operator.process.poll() is None
