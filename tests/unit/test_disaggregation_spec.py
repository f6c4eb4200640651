"""spec.disaggregation parsed into Disaggregation and Pool, and what cannot be honoured refused naming the field."""

import pytest

from goodput_contract.api.spec import Disaggregation, Pool, SpecError, parse


def _spec(engine="goodput", extra_args=(), tensor=1, **disaggregation):
    spec = {
        "model": {"source": "hf://acme/tiny"},
        "engine": {"kind": engine, "extraArgs": list(extra_args)},
        "parallelism": {"tensor": tensor},
        "disaggregation": {"prefill": {"minReplicas": 1, "maxReplicas": 4}, "decode": {"minReplicas": 2}},
    }
    spec["disaggregation"].update(disaggregation)
    return spec


def _refusal(spec):
    with pytest.raises(SpecError) as caught:
        parse("chat", "ns", spec)
    return caught.value


def test_off_by_default():
    assert parse("chat", "ns", {"model": {"source": "hf://acme/tiny"}}).disaggregation is None


def test_goodput_engine_parses_with_its_defaults():
    svc = parse("chat", "ns", _spec())
    assert svc.disaggregation == Disaggregation(
        prefill=Pool(min_replicas=1, max_replicas=4), decode=Pool(min_replicas=2, max_replicas=2)
    )
    assert (svc.disaggregation.threshold_tokens, svc.disaggregation.transport) == (512, "tcp")


def test_vllm_engine_defaults_to_its_nixl_connector():
    svc = parse("chat", "ns", _spec("vllm", threshold=1024))
    assert svc.disaggregation is not None
    assert (svc.disaggregation.transport, svc.disaggregation.threshold_tokens) == ("nixl", 1024)


def test_decode_pool_follows_spec_replicas_within_its_bounds():
    def replicas(**spec):
        return parse("chat", "ns", {**_spec(decode={"minReplicas": 2, "maxReplicas": 5}), **spec}).desired_replicas

    assert replicas() == 2  # decode.minReplicas while spec.replicas is unset
    assert replicas(replicas=4) == 4
    assert replicas(replicas=9) == 5
    assert replicas(replicas=0) == 2
    assert replicas(replicas=4, suspend=True) == 0


@pytest.mark.parametrize(
    ("spec", "field", "reason"),
    [
        (_spec("sglang"), "spec.disaggregation", "EngineUnsupportedField"),
        (_spec(transport="nixl"), "spec.disaggregation.transport", "TransportUnsupported"),
        (_spec("vllm", transport="tcp"), "spec.disaggregation.transport", "TransportUnsupported"),
        (_spec(threshold=15), "spec.disaggregation.threshold", "ThresholdBelowBlock"),
        (
            _spec(prefill={"minReplicas": 3, "maxReplicas": 2}),
            "spec.disaggregation.prefill.minReplicas",
            "ReplicaBoundsInverted",
        ),
        (
            _spec(decode={"minReplicas": 4, "maxReplicas": 1}),
            "spec.disaggregation.decode.minReplicas",
            "ReplicaBoundsInverted",
        ),
        # tcp moves whole blocks of one layout: any difference in tensor size is refused
        (_spec(prefill={"tensor": 2}), "spec.disaggregation.prefill.tensor", "TensorSizeMismatch"),
        (_spec(tensor=2, decode={"tensor": 4}), "spec.disaggregation.decode.tensor", "TensorSizeMismatch"),
        # nixl maps KV heads only between sizes of which one divides the other
        (
            _spec("vllm", prefill={"tensor": 2}, decode={"tensor": 3}),
            "spec.disaggregation.prefill.tensor",
            "TensorSizeMismatch",
        ),
        (_spec(prefill="all"), "spec.disaggregation.prefill", "InvalidSpec"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_field(spec, field, reason):
    err = _refusal(spec)
    assert (err.field, err.reason) == (field, reason)
    assert str(err).startswith(f"{field}: ")


def test_nixl_maps_tensor_sizes_that_divide_each_other():
    svc = parse("chat", "ns", _spec("vllm", tensor=2, prefill={"tensor": 4}))
    assert svc.disaggregation is not None and svc.disaggregation.prefill.tensor == 4


def test_the_threshold_is_checked_against_the_block_size_the_engine_runs():
    assert parse("chat", "ns", _spec(threshold=16)).disaggregation is not None  # the default block: 16 tokens
    for args in (["--block-size", "32"], ["--block-size=32"]):
        err = _refusal(_spec(extra_args=args, threshold=16))
        assert err.field == "spec.disaggregation.threshold" and "32 tokens" in str(err)
    assert parse("chat", "ns", _spec(extra_args=["--block-size", "32"], threshold=32)).disaggregation is not None


def test_shapes_the_hand_off_cannot_move_are_refused():
    pipeline = {**_spec(), "parallelism": {"tensor": 1, "pipeline": 2}}
    assert _refusal(pipeline).field == "spec.parallelism.pipeline"
    nodes = {**_spec(tensor=2), "parallelism": {"tensor": 2, "nodes": 2}}
    assert _refusal(nodes).field == "spec.parallelism.nodes"


def test_a_role_larger_than_a_node_is_refused():
    spec = {**_spec(prefill={"tensor": 2}, transport=None), "engine": {"kind": "vllm"}}
    spec["resources"] = {"gpu": 1, "gpusPerNode": 1}
    err = _refusal(spec)
    assert (err.field, err.reason) == ("spec.disaggregation.prefill.tensor", "ShapeDoesNotFit")
    spec["resources"] = {"gpu": 1, "gpusPerNode": 2}
    assert parse("chat", "ns", spec).disaggregation is not None
