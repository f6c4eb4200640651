"""The autoscaler's start-up horizon for replicas spanning pods: a replica is a group, and it counts as started
when the group's leader is a ready endpoint, which it becomes only once every worker pod has joined and loaded
its share. So the time measured runs from the group being wanted to the whole group serving.

The EndpointSlices are written as the EndpointSlice controller writes them for a service's client Service: its
selector takes every pod of every group, and a worker's readiness probe (/health?serving) always fails, so a
worker is an endpoint that is never ready.
"""

from __future__ import annotations

import asyncio
from typing import Any

from goodput_operator.autoscaling.sources import service_endpoints
from goodput_operator.autoscaling.startup import StartupClock


class Slices:
    """The API server's answer to the autoscaler's EndpointSlice list: pods -> ready."""

    def __init__(self) -> None:
        self.pods: dict[str, bool] = {}

    async def request(self, method: str, path: str, query: dict[str, str] | None = None) -> dict[str, Any]:
        assert (method, path) == ("GET", "/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices")
        assert query == {"labelSelector": "kubernetes.io/service-name=big"}
        endpoints = [
            {"addresses": [f"10.244.0.{i + 10}"], "conditions": {"ready": ready}, "targetRef": {"name": pod}}
            for i, (pod, ready) in enumerate(sorted(self.pods.items()))
        ]
        ports = [{"name": "http", "port": 8000}, {"name": "metrics", "port": 8000}]
        return {"items": [{"metadata": {"name": "big-abcde"}, "endpoints": endpoints, "ports": ports}]}


def ready_groups(slices: Slices) -> int:
    endpoints = asyncio.run(service_endpoints(slices, "discovery.k8s.io/v1", "ns", "big"))  # type: ignore[arg-type]
    return len(endpoints.ready)


def test_a_groups_start_up_runs_until_its_leader_is_ready_so_it_includes_every_worker() -> None:
    slices = Slices()
    slices.pods = {"big-runtime-0-0": True, "big-runtime-0-1": False}  # one group serving; its worker never ready
    clock = StartupClock()
    assert ready_groups(slices) == 1
    assert clock.observe(0.0, current=1, ready=ready_groups(slices)) is None

    # scaled to two groups: the second group's pods start
    slices.pods |= {"big-runtime-1-0": False, "big-runtime-1-1": False}
    assert clock.observe(10.0, current=2, ready=ready_groups(slices)) is None
    # its worker is up and has loaded its share: still no ready replica more (a worker is never an endpoint that serves)
    slices.pods["big-runtime-1-1"] = False
    assert ready_groups(slices) == 1
    assert clock.observe(40.0, current=2, ready=ready_groups(slices)) is None
    # the leader turns ready once every rank of its group has joined: the group's start-up is a sample
    slices.pods["big-runtime-1-0"] = True
    assert ready_groups(slices) == 2
    assert clock.observe(95.0, current=2, ready=ready_groups(slices)) == 85.0
    assert clock.samples == 1


def test_a_group_whose_worker_died_restarts_as_a_whole_and_its_recovery_is_a_sample() -> None:
    slices = Slices()
    slices.pods = {"big-runtime-0-0": True, "big-runtime-0-1": False, "big-runtime-1-0": True, "big-runtime-1-1": False}
    clock = StartupClock()
    clock.observe(0.0, current=2, ready=ready_groups(slices))
    # group 1's worker died: its leader exits (the group restarts as a unit) and is not ready until the group is
    slices.pods["big-runtime-1-0"] = False
    assert clock.observe(5.0, current=2, ready=ready_groups(slices)) is None
    slices.pods["big-runtime-1-0"] = True
    assert clock.observe(65.0, current=2, ready=ready_groups(slices)) == 60.0
