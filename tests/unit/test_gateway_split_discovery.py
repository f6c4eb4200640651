"""The gateway's view of a disaggregated InferenceService: spec.disaggregation through the contract's
parse, and its prefill pool as the `<name>-prefill` Service's ready endpoints."""

from goodput_gateway.discovery import Registry, Split, service_of


def isvc(spec: dict) -> dict:
    return {"metadata": {"namespace": "ns", "name": "chat"}, "spec": {"model": {"source": "file:///m"}, **spec}}


def test_a_disaggregated_service_reads_its_threshold_and_its_prefill_pool():
    split = {"prefill": {"minReplicas": 1, "maxReplicas": 2}, "decode": {"minReplicas": 1, "maxReplicas": 4}}
    svc = service_of(isvc({"disaggregation": {**split, "threshold": 1024}}))
    assert svc is not None and svc.disaggregation == Split(threshold_tokens=1024, transport="tcp")
    assert svc.prefill_key == ("ns", "chat-prefill")
    plain = service_of(isvc({}))
    assert plain is not None and plain.disaggregation is None

    registry = Registry()
    registry.slices.fill(
        {
            ("ns", "chat-a"): (("ns", "chat"), ("http://10.0.0.1:8000",)),
            ("ns", "chat-prefill-a"): (("ns", "chat-prefill"), ("http://10.0.0.2:8000",)),
        }
    )
    assert registry.ready(("ns", "chat")) == ("http://10.0.0.1:8000",)  # the decode pool: the Service itself
    assert registry.ready(svc.prefill_key) == ("http://10.0.0.2:8000",)


def test_an_invalid_disaggregation_is_not_routed():
    bad = {"prefill": {"minReplicas": 2, "maxReplicas": 1}, "decode": {"minReplicas": 1, "maxReplicas": 4}}
    assert service_of(isvc({"disaggregation": bad})) is None
