"""An invalid spec is refused with Valid=False, and a fit check that made it invalid shows as ModelFits=False."""

import asyncio

from operator_fakes import FakeContext

from goodput_operator.conditions import find
from goodput_operator.reconcile import _reconcile


def _body(spec, status=None):
    return {
        "apiVersion": "serving.goodput.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"namespace": "ns", "name": "chat", "uid": "u", "generation": 2},
        "spec": spec,
        "status": status or {},
    }


def test_fp8_on_cpu_writes_model_fits_false_beside_valid_false():
    ctx = FakeContext()
    body = _body({"model": {"source": "hf://org/model", "quantization": "fp8"}, "resources": {"gpu": 0}})
    assert asyncio.run(_reconcile(ctx, body)) == "invalid"
    (status,) = ctx.kube.statuses
    conditions = status["conditions"]
    assert [c["type"] for c in conditions] == ["Ready", "Valid", "ModelFits", "Reconciling", "Stalled"]
    assert find(conditions, "Stalled")["status"] == "True" and find(conditions, "Reconciling")["status"] == "False"
    assert find(conditions, "Valid")["reason"] == find(conditions, "ModelFits")["reason"] == "QuantizationUnsupported"
    assert find(conditions, "ModelFits")["status"] == "False"
    # one Event: the fit problem is the invalidity
    assert [(t, r) for t, r, _ in ctx.events] == [("Warning", "Invalid")]

    again = FakeContext()  # the same pass over its own status writes and posts nothing
    assert asyncio.run(_reconcile(again, _body(body["spec"], status))) == "invalid"
    assert (again.kube.statuses, again.events) == ([], [])


def test_a_spec_that_does_not_parse_has_no_model_fits():
    ctx = FakeContext()
    body = _body({"model": {"source": "hf://org/model"}, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}})
    assert asyncio.run(_reconcile(ctx, body)) == "invalid"
    (status,) = ctx.kube.statuses
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Valid", "Reconciling", "Stalled"]
