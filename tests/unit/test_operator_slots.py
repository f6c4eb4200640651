"""The operator's bookkeeping for thousands of services: slots by priority, side triggers once, watched objects."""

import asyncio

from goodput_operator.observed import Observed
from goodput_operator.workqueue import CHANGE, RESUME, RESYNC, SIDE, SideQueue, Slots


def test_slots_admit_a_user_change_then_the_backlog_before_side_triggers_that_waited_longer():
    async def scenario() -> list[str]:
        slots, order = Slots(1), []
        gate = asyncio.Event()

        async def run(name: str, priority: int) -> None:
            async with slots.hold(priority):
                order.append(name)
                await gate.wait()

        first = asyncio.create_task(run("first", RESUME))
        await asyncio.sleep(0)
        waiting = [
            asyncio.create_task(run(name, priority))
            for name, priority in (("resync", RESYNC), ("backlog", RESUME), ("side", SIDE), ("apply", CHANGE))
        ]
        await asyncio.sleep(0)
        assert slots.waiting == 4
        gate.set()
        await asyncio.gather(first, *waiting)
        return order

    assert asyncio.run(scenario()) == ["first", "apply", "backlog", "side", "resync"]


def test_a_cancelled_waiter_gives_its_turn_to_the_next():
    async def scenario() -> list[str]:
        slots, order = Slots(1), []
        release = asyncio.Event()

        async def run(name: str) -> None:
            async with slots.hold(CHANGE):
                order.append(name)
                await release.wait()

        holder = asyncio.create_task(run("holder"))
        await asyncio.sleep(0)
        gone, next_ = asyncio.create_task(run("gone")), asyncio.create_task(run("next"))
        await asyncio.sleep(0)
        gone.cancel()
        release.set()
        await asyncio.gather(holder, next_)
        return order

    assert asyncio.run(scenario()) == ["holder", "next"]


def test_side_triggers_queue_a_service_once_until_it_is_taken():
    async def scenario() -> list[tuple[str, str]]:
        queue = SideQueue()
        for _ in range(5):  # a Deployment, its status updates, its pod: one burst
            queue.add("ns", "chat")
        queue.add("ns", "other")
        assert len(queue) == 2
        taken = [await queue.next(), await queue.next()]
        queue.add("ns", "chat")  # a trigger after it was taken queues it again
        taken.append(await queue.next())
        return taken

    assert asyncio.run(scenario()) == [("ns", "chat"), ("ns", "other"), ("ns", "chat")]


def test_watched_children_and_pods_are_kept_without_managed_fields():
    observed = Observed()
    deployment = {
        "kind": "Deployment",
        "metadata": {"name": "chat-runtime", "namespace": "ns", "managedFields": [{"manager": "x"}] * 50},
        "spec": {"replicas": 1},
    }
    observed.child_event(None, deployment)
    kept = observed.child("Deployment", "ns", "chat-runtime")
    assert kept["spec"] == {"replicas": 1} and "managedFields" not in kept["metadata"]
    observed.child_event("DELETED", deployment)
    assert observed.child("Deployment", "ns", "chat-runtime") is None

    pod = {
        "metadata": {"name": "chat-runtime-1", "namespace": "ns", "labels": {"a": "b"}},
        "spec": {"containers": [{"name": "runtime"}]},
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False"}]},
    }
    observed.pod_event("ADDED", pod, "chat")
    assert observed.pods("ns", "chat") == [
        {
            "metadata": {"name": "chat-runtime-1"},
            "status": {"phase": "Pending", "conditions": pod["status"]["conditions"]},
        }
    ]
    observed.pod_event("DELETED", pod, "chat")
    assert observed.pods("ns", "chat") == []
