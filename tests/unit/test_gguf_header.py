"""The contract's GGUF header reader, against files written by llama.cpp's own gguf package."""

from __future__ import annotations

from pathlib import Path

import gguf as gguf_py
import numpy as np
import pytest

from goodput_contract import gguf
from goodput_operator.capacity import ModelConfig

Q = gguf_py.GGMLQuantizationType


def write(
    path: Path,
    arch: str = "llama",
    name: str = "Tiny Test",
    tensor_type=Q.Q4_1,
    tied: bool = True,
    vocab: int = 300,
    bias: bool = False,
) -> Path:
    writer = gguf_py.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(2)
    writer.add_context_length(2048)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(16)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])  # long: only counted
    writer.add_array("test.short", [1, 2, 3])
    writer.add_float32("test.float", 0.5)
    writer.add_bool("test.flag", True)
    writer.add_tensor("token_embd.weight", np.zeros((vocab, 64), dtype=np.float32))
    block, size = gguf_py.GGML_QUANT_SIZES[tensor_type]
    raw = np.zeros((128, 64 // block * size), dtype=np.uint8)
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=tensor_type)  # [128, 64] from the bytes per row
    if bias:
        writer.add_tensor("blk.0.attn_q.bias", np.zeros(64, dtype=np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((vocab, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_reads_as_the_gguf_package_reads_it(tmp_path):
    path = write(tmp_path / "m.gguf")
    header = gguf.read_header(path)
    theirs = gguf_py.GGUFReader(path)
    assert header.version == 3
    assert header.architecture == "llama"
    assert header.metadata["llama.block_count"] == 2
    assert header.metadata["test.short"] == [1, 2, 3]
    assert header.metadata["test.float"] == 0.5 and header.metadata["test.flag"] is True
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 300
    assert set(header.metadata) == {key for key in theirs.fields if not key.startswith("GGUF.")}
    assert [t.name for t in header.tensors] == [t.name for t in theirs.tensors]
    assert [t.type_name for t in header.tensors] == [t.tensor_type.name for t in theirs.tensors]
    assert header.tensor_types() == {"F32": 1, "Q4_1": 1}


@pytest.mark.parametrize(
    ("arch", "name", "architecture", "model_type"),
    [
        ("llama", "Tiny Test", "LlamaForCausalLM", "llama"),
        ("llama", "Mistral 7B Instruct", "MistralForCausalLM", "mistral"),
        ("qwen2", "Qwen2.5 0.5B", "Qwen2ForCausalLM", "qwen2"),
    ],
)
def test_the_config_it_implies_sizes_the_model(tmp_path, arch, name, architecture, model_type):
    config = gguf.hf_config(gguf.read_header(write(tmp_path / "m.gguf", arch, name, bias=arch == "qwen2")))
    assert config["architectures"] == [architecture] and config["model_type"] == model_type
    sized = ModelConfig.from_dict(config)
    assert (sized.hidden_size, sized.num_layers, sized.num_heads, sized.num_kv_heads) == (64, 2, 4, 2)
    assert (sized.intermediate_size, sized.vocab_size, sized.max_position_embeddings) == (128, 300, 2048)
    assert sized.tie_word_embeddings
    assert sized.attention_bias == (arch == "qwen2")


def test_an_output_tensor_means_untied_embeddings(tmp_path):
    config = gguf.hf_config(gguf.read_header(write(tmp_path / "m.gguf", tied=False)))
    assert config["tie_word_embeddings"] is False


def test_an_unmapped_architecture_is_named(tmp_path):
    config = gguf.hf_config(gguf.read_header(write(tmp_path / "m.gguf", arch="rwkv6")))
    assert config["architectures"] == ["rwkv6 (GGUF architecture)"]


def test_unsupported_tensor_types_are_named_with_the_supported_ones(tmp_path):
    header = gguf.read_header(write(tmp_path / "m.gguf", tensor_type=Q.Q8_0))
    assert gguf.quantization_problem(header, ["F32", "Q8_0"], "m.gguf") is None
    problem = gguf.quantization_problem(header, ["F32", "Q4_1"], "m.gguf")
    assert problem == (
        "m.gguf holds tensors of unsupported GGUF quantization type Q8_0 (1 tensors, e.g. "
        "blk.0.ffn_up.weight); supported: F32, Q4_1"
    )


def test_not_gguf_and_truncated_headers_are_refused(tmp_path):
    path = write(tmp_path / "m.gguf")
    data = path.read_bytes()
    with pytest.raises(gguf.GGUFError, match="is not a GGUF file"):
        gguf.read_header(b"PK\x03\x04" + data[4:], "x.gguf")
    with pytest.raises(gguf.GGUFError, match="the GGUF header ends early"):
        gguf.read_header(data[:1000], "first bytes")
    # the header alone, without the tensor data, is enough
    assert len(gguf.read_header(data[: len(data) - 128 * 64 * 4]).tensors) == 2
