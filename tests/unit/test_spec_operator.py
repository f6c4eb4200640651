"""spec.engine.speculative: parsed and checked once, carried to the runtime's own flags, refused by the
engines that do not take it, and counted in the capacity plan when it brings a draft model."""

from __future__ import annotations

import pytest

from goodput_contract.api.spec import SpecError, parse
from goodput_operator import capacity, engines
from goodput_operator.builders import runtime_args
from goodput_operator.capacity import ModelConfig
from goodput_runtime.__main__ import build_parser

SMOLLM2 = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def service(speculative: dict, kind: str = "goodput", source: str = "hf://HuggingFaceTB/SmolLM2-1.7B-Instruct"):
    svc = parse(
        "chat",
        "ns",
        {"model": {"source": source}, "engine": {"kind": kind, "speculative": speculative}, "resources": {"gpu": 1}},
    )
    engines.validate(svc)
    return svc


def test_prompt_lookup_reaches_the_runtime_as_its_flags():
    args = build_parser().parse_args(runtime_args(service({"method": "ngram", "tokens": 5})))
    assert (args.speculative_method, args.num_speculative_tokens, args.speculative_model) == ("ngram", 5, None)


def test_a_draft_model_on_the_hub_is_passed_by_its_id_and_one_on_the_models_claim_by_its_mount():
    args = build_parser().parse_args(runtime_args(service({"method": "draft", "draftModel": "hf://org/draft-135m"})))
    assert (args.speculative_method, args.num_speculative_tokens, args.speculative_model) == (
        "draft",
        3,
        "org/draft-135m",
    )
    svc = service({"method": "draft", "draftModel": "pvc://models/draft"}, source="pvc://models/target")
    args = build_parser().parse_args(runtime_args(svc))
    assert args.speculative_model == engines.SOURCE_MOUNT + "/draft"
    assert args.model == engines.SOURCE_MOUNT + "/target"


@pytest.mark.parametrize(
    ("speculative", "source", "message"),
    [
        ({"method": "draft"}, "hf://org/m", "spec.engine.speculative.draftModel: is required with method draft"),
        (
            {"method": "ngram", "draftModel": "hf://org/d"},
            "hf://org/m",
            "spec.engine.speculative.draftModel: is only used",
        ),
        (
            {"method": "draft", "draftModel": "s3://bucket/d"},
            "hf://org/m",
            "spec.engine.speculative.draftModel: 's3://",
        ),
        (
            {"method": "draft", "draftModel": "pvc://other/d"},
            "pvc://models/m",
            "spec.engine.speculative.draftModel: may name a claim only",
        ),
    ],
)
def test_a_bad_speculative_spec_is_refused_naming_the_field(speculative, source, message):
    with pytest.raises(SpecError) as err:
        service(speculative, source=source)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_other_engines_refuse_speculative_naming_it(kind):
    with pytest.raises(SpecError) as err:
        service({"method": "ngram"}, kind=kind)
    assert err.value.field == "spec.engine.speculative"


def test_a_draft_model_adds_its_weights_and_kv_cache_to_the_capacity_plan():
    target = ModelConfig.from_dict(
        {
            **SMOLLM2,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 24,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
        }
    )
    draft = ModelConfig.from_dict(SMOLLM2)
    kwargs = {
        "dtype": "bfloat16",
        "quantization": "none",
        "tensor": 1,
        "max_model_len": 8192,
        "device_memory_bytes": 24 << 30,
        "utilization": 0.9,
    }
    alone = capacity.plan(target, **kwargs)
    both = capacity.plan(target, draft=draft, **kwargs)
    assert both.weight_bytes == alone.weight_bytes + capacity.weight_bytes(draft, "bfloat16")
    assert both.kv_bytes_per_token == alone.kv_bytes_per_token + capacity.kv_bytes_per_token(draft, "bfloat16")
    assert both.max_concurrent_sequences is not None and alone.max_concurrent_sequences is not None
    assert both.max_concurrent_sequences < alone.max_concurrent_sequences
