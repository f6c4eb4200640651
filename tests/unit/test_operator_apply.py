"""When a child needs writing: only when the server's copy differs from the desired one."""

import json

from goodput_operator.k8s import ApiError, is_subset, resource_path


def test_server_defaults_do_not_count_as_drift():
    desired = {"spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "runtime", "image": "a"}]}}}}
    live = {
        "spec": {
            "replicas": 1,
            "revisionHistoryLimit": 10,
            "template": {
                "spec": {
                    "containers": [{"name": "runtime", "image": "a", "terminationMessagePath": "/dev/termination-log"}],
                    "dnsPolicy": "ClusterFirst",
                }
            },
        }
    }
    assert is_subset(desired, live)


def test_hand_edits_count_as_drift():
    desired = {"spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "runtime", "image": "a"}]}}}}
    assert not is_subset(desired, {"spec": {"replicas": 5, "template": desired["spec"]["template"]}})
    edited = {"spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "runtime", "image": "b"}]}}}}
    assert not is_subset(desired, edited)
    extra = {
        "spec": {
            "replicas": 1,
            "template": {
                "spec": {"containers": [{"name": "runtime", "image": "a"}, {"name": "sidecar", "image": "c"}]}
            },
        }
    }
    assert not is_subset(desired, extra)


def test_booleans_and_numbers_are_not_confused():
    assert not is_subset({"readOnly": True}, {"readOnly": 1})
    assert is_subset({"port": 8000}, {"port": 8000})
    assert is_subset({"nvidia.com/gpu": "1"}, {"nvidia.com/gpu": "1"})


def test_resource_paths():
    assert resource_path("apps/v1", "Deployment", "ns", "x") == "/apis/apps/v1/namespaces/ns/deployments/x"
    assert resource_path("v1", "Service", "ns") == "/api/v1/namespaces/ns/services"


def test_a_namespace_being_deleted_is_told_apart_from_other_refusals():
    def error(status, message):
        return ApiError(status, "x", json.dumps({"kind": "Status", "message": message}))

    assert error(
        403,
        'deployments.apps "a" is forbidden: unable to create new content in namespace t because it is being terminated',
    ).namespace_going
    assert error(404, 'namespaces "t" not found').namespace_going
    assert not error(403, 'deployments.apps "a" is forbidden: User "x" cannot create resource').namespace_going
    assert not error(404, 'deployments.apps "a" not found').namespace_going
