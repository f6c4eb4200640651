"""Why runtime pods do not serve, read from pod status as kubelet and scheduler write it."""

import asyncio

from operator_fakes import FakeContext

from goodput_operator.conditions import FALSE, TRUE
from goodput_operator.pods import Failure, failure, one_line
from goodput_operator.reconcile import _available, _report_failure

CANNOT_SERVE = "Cannot serve /mnt/models/missing-dir: no config.json there"


def pod(name="chat-runtime-abc", phase="Pending", containers=(), conditions=(), deleting=False):
    meta = {"name": name, "namespace": "ns"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "status": {"phase": phase, "containerStatuses": list(containers), "conditions": list(conditions)},
    }


def crash_looping(restarts=3, message=CANNOT_SERVE, code=1, reason="Error"):
    return {
        "name": "runtime",
        "image": "img",
        "ready": False,
        "restartCount": restarts,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed"}},
        "lastState": {"terminated": {"exitCode": code, "reason": reason, "message": message}},
    }


def test_a_crash_loop_names_the_pod_exit_code_restarts_and_termination_message():
    f = failure([pod(phase="Running", containers=[crash_looping()])])
    assert f is not None and f.reason == "RuntimeFailing"
    assert f.message == f"pod chat-runtime-abc: runtime exited 1 (3 restarts): {CANNOT_SERVE}"


def test_the_same_failure_after_another_restart_or_on_another_pod_has_the_same_key():
    one = failure([pod(containers=[crash_looping(restarts=1)])])
    two = failure([pod(name="chat-runtime-xyz", containers=[crash_looping(restarts=7)])])
    assert one.message.endswith(f"(1 restart): {CANNOT_SERVE}")
    assert one.key == two.key and one.message != two.message
    other = failure([pod(containers=[crash_looping(message="Unsupported architecture FooForCausalLM")])])
    assert other.key != one.key


def test_oom_kill_without_a_message_says_so():
    f = failure([pod(containers=[crash_looping(code=137, reason="OOMKilled", message="")])])
    assert f.message == "pod chat-runtime-abc: runtime exited 137 (OOMKilled, 3 restarts)"


def test_between_two_crashes_a_restarted_container_still_counts_as_failing():
    restarted = {**crash_looping(restarts=2), "state": {"running": {"startedAt": "2026-01-01T00:01:00Z"}}}
    not_ready_since_before = {
        "type": "ContainersReady",
        "status": "False",
        "lastTransitionTime": "2026-01-01T00:00:30Z",
    }
    f = failure([pod(phase="Running", containers=[restarted], conditions=[not_ready_since_before])])
    assert f is not None and f.reason == "RuntimeFailing"
    # ready once since this start, then not: a readiness hiccup, not the old crash
    hiccup = {**not_ready_since_before, "lastTransitionTime": "2026-01-01T00:09:00Z"}
    assert failure([pod(phase="Running", containers=[restarted], conditions=[hiccup])]) is None
    serving = {**restarted, "ready": True}
    assert failure([pod(phase="Running", containers=[serving])]) is None


def test_the_crashs_turn_to_not_ready_recorded_after_the_restart_is_still_the_crash():
    # the kubelet wrote ContainersReady False three seconds after the new container started: too soon for
    # the readiness probe (every 5 s, 3 failures) to have turned it Ready and back, so still the crash
    restarted = {**crash_looping(restarts=1), "state": {"running": {"startedAt": "2026-01-01T00:01:00Z"}}}
    late = {"type": "ContainersReady", "status": "False", "lastTransitionTime": "2026-01-01T00:01:03Z"}
    probed = pod(phase="Running", containers=[restarted], conditions=[late])
    probed["spec"] = {
        "containers": [{"name": "runtime", "readinessProbe": {"periodSeconds": 5, "failureThreshold": 3}}]
    }
    f = failure([probed])
    assert f is not None and f.message.startswith("pod chat-runtime-abc: runtime exited 1 (1 restart)")
    # twenty seconds after the start the probe could have: a hiccup of this run, not the crash
    probed["status"]["conditions"] = [{**late, "lastTransitionTime": "2026-01-01T00:01:20Z"}]
    assert failure([probed]) is None
    # with no probe in the spec, only a turn before or at the start is the crash's (as before)
    del probed["spec"]
    probed["status"]["conditions"] = [late]
    assert failure([probed]) is None


def test_image_and_config_problems_carry_the_kubelets_message():
    pull = {
        "name": "runtime",
        "image": "registry.test/nope:1",
        "restartCount": 0,
        "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x"'}},
    }
    f = failure([pod(containers=[pull])])
    assert f.reason == "ImagePullFailed"
    assert f.message == (
        'pod chat-runtime-abc: cannot pull image registry.test/nope:1 (ImagePullBackOff): Back-off pulling image "x"'
    )
    err = {**pull, "state": {"waiting": {"reason": "ErrImagePull", "message": "rpc error: not found"}}}
    assert failure([pod(containers=[err])]).key == f.key  # the two alternate; one failure
    config = {
        "name": "runtime",
        "image": "img",
        "restartCount": 0,
        "state": {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}},
    }
    f = failure([pod(containers=[config])])
    assert (f.reason, f.message) == (
        "ContainerConfigError",
        'pod chat-runtime-abc: runtime cannot start (CreateContainerConfigError): secret "hf" not found',
    )


def test_unschedulable_carries_the_schedulers_message():
    scheduled = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    }
    f = failure([pod(conditions=[scheduled])])
    assert (f.reason, f.message) == (
        "Unschedulable",
        "pod chat-runtime-abc: cannot be scheduled: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    )


def test_starting_terminating_and_evicted_pods_are_not_failures():
    creating = {
        "name": "runtime",
        "image": "img",
        "restartCount": 0,
        "state": {"waiting": {"reason": "ContainerCreating"}},
    }
    assert failure([pod(containers=[creating]), pod()]) is None
    assert failure([pod(containers=[crash_looping()], deleting=True)]) is None
    assert failure([pod(phase="Failed", containers=[crash_looping()])]) is None


def test_the_most_severe_failure_is_reported_then_the_first_pod():
    scheduled = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "no GPUs"}
    f = failure(
        [
            pod("b", conditions=[scheduled]),
            pod("c", containers=[crash_looping()]),
            pod("a", containers=[crash_looping()]),
        ]
    )
    assert f.reason == "RuntimeFailing" and f.message.startswith("pod a:")


def test_a_log_tail_is_trimmed_to_the_line_that_names_the_error():
    tail = (
        'INFO loading weights\nTraceback (most recent call last):\n  File "x.py", line 3, in <module>\n'
        "    raise ValueError(msg)\nValueError: unsupported architecture FooForCausalLM\n"
    )
    assert one_line(tail) == "ValueError: unsupported architecture FooForCausalLM"
    assert one_line("Cannot serve /m:\nno config.json\n") == "Cannot serve /m: no config.json"
    assert len(one_line("x" * 1000)) == 300


def test_available_says_why_no_pod_serves_and_only_names_a_failure_beside_serving_pods():
    f = Failure("RuntimeFailing", "pod p: runtime exited 1 (3 restarts): boom", ("runtime exited 1", "boom"))
    none_ready = {"status": {"readyReplicas": 0}}
    c = _available(none_ready, 2, f)
    assert (c.status, c.reason, c.message) == (FALSE, "RuntimeFailing", f.message)
    c = _available({"status": {"readyReplicas": 1}}, 2, f)
    assert (c.status, c.reason, c.message) == (TRUE, "MinimumReplicasAvailable", f"1/2 replicas ready; {f.message}")
    assert _available(none_ready, 2, None).reason == "ReplicasNotReady"
    assert _available(none_ready, 0, f).reason == "ScaledToZero"


def _body(available_message=""):
    conditions = (
        [{"type": "Available", "status": "False", "reason": "RuntimeFailing", "message": available_message}]
        if available_message
        else []
    )
    return {"metadata": {"namespace": "ns", "name": "chat", "uid": "u"}, "status": {"conditions": conditions}}


def _report(ctx, body, f):
    return _report_failure(ctx, body, f, body["status"]["conditions"])


def test_one_event_per_distinct_failure_and_again_after_it_cleared():
    ctx = FakeContext()
    three = failure([pod(containers=[crash_looping(restarts=3)])])
    four = failure([pod(containers=[crash_looping(restarts=4)])])
    other = failure([pod(containers=[crash_looping(message="CUDA out of memory")])])

    async def run():
        for f in (three, three, four, three):
            await _report(ctx, _body(), f)
        assert [e[1] for e in ctx.events] == ["RuntimeFailing"]
        await _report(ctx, _body(), other)
        await _report(ctx, _body(), None)  # serves again
        await _report(ctx, _body(), three)

    asyncio.run(run())
    assert [e[2] for e in ctx.events] == [three.message, other.message, three.message]
    assert all(e[0] == "Warning" for e in ctx.events)


def test_after_an_operator_restart_the_condition_stands_in_for_the_memory():
    three = failure([pod(containers=[crash_looping(restarts=3)])])
    four = failure([pod(containers=[crash_looping(restarts=4)])])
    other = failure([pod(containers=[crash_looping(message="CUDA out of memory")])])
    restarted = FakeContext()  # nothing remembered; the status already tells `three`
    asyncio.run(_report(restarted, _body(available_message=three.message), four))
    assert restarted.events == []
    restarted = FakeContext()
    asyncio.run(_report(restarted, _body(available_message=three.message), other))
    assert [e[2] for e in restarted.events] == [other.message]


def test_a_groups_worker_restarted_after_a_crash_recovers_when_its_leader_is_ready_again():
    """A worker pod of a replica spanning pods is never ready (only its group's leader takes requests): its
    crash is over once the leader is ready again, which it turns only when every worker has joined."""
    worker = {
        **crash_looping(restarts=1, message="the leader closed its connection"),
        "state": {"running": {"startedAt": "2026-01-01T00:01:00Z"}},
    }
    leader_ready = [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]
    leader_not_ready = [{"type": "Ready", "status": "False"}, {"type": "ContainersReady", "status": "False"}]
    serving = {"name": "runtime", "ready": True, "restartCount": 0, "state": {"running": {}}}
    starting = {**serving, "ready": False}
    for leader, workers in (("big-runtime-0-0", ["big-runtime-0-1"]), ("big-runtime-0", ["big-runtime-0-1"])):
        group_down = [pod(leader, "Running", [starting], leader_not_ready)]
        group_up = [pod(leader, "Running", [serving], leader_ready)]
        workers_pods = [pod(w, "Running", [worker]) for w in workers]
        f = failure(group_down + workers_pods)
        assert f is not None and f.message.startswith(f"pod {workers[0]}: runtime exited 1 (1 restart)")
        assert failure(group_up + workers_pods) is None  # StatefulSet and LeaderWorkerSet names alike
    # another group's ready leader says nothing of this worker
    assert failure(
        [pod("big-runtime-1-0", "Running", [serving], leader_ready), pod("big-runtime-0-1", "Running", [worker])]
    )
    # a worker in a crash loop is failing whatever its leader says
    looping = [
        pod("big-runtime-0-0", "Running", [serving], leader_ready),
        pod("big-runtime-0-1", "Running", [crash_looping()]),
    ]
    assert failure(looping) is not None
