"""The runtime's compact model modules: they serve Llama, Qwen2 and Mistral by default, give
transformers' greedy tokens and logits, keep quantization working, and step aside when asked."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from test_engine_greedy import reference, run_all, small_config, workload

from goodput_runtime.engine.builder import build_core
from goodput_runtime.engine.contention import ContentionWatch
from goodput_runtime.engine.step import StepItem
from goodput_runtime.layers import native_attention
from goodput_runtime.layers.quantization import QuantizedLinear
from goodput_runtime.layers.step_plan import NATIVE, ONEDNN, TRANSPOSED, StepPlan
from goodput_runtime.models import llama
from goodput_runtime.models.llama import CausalLM


def mistral_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny Llama's weights as a Mistral with a sliding window shorter than the prompts."""
    model_dir = tmp_path / "mistral"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_compact_modules_serve_by_default_and_give_transformers_greedy_tokens(
    arch, tiny_model_dir, tiny_qwen2_dir, tmp_path
):
    model_dir = {"llama": tiny_model_dir, "qwen2": tiny_qwen2_dir}.get(arch) or mistral_dir(tiny_model_dir, tmp_path)
    cases = workload(seed=3, n=8)
    expected = reference(model_dir, cases)
    compact = build_core(small_config(model_dir, blocks=200))
    assert isinstance(compact.runner.model, CausalLM)
    assert run_all(compact, cases) == expected
    config = small_config(model_dir, blocks=200)
    config.model_impl = "transformers"
    generic = build_core(config)
    assert not isinstance(generic.runner.model, CausalLM)
    assert run_all(generic, cases) == expected


def mixed_step() -> list[StepItem]:
    """One step (blocks of 4) holding a decode, a whole prompt and a prompt chunk after cached context."""
    return [
        StepItem([7], 9, [0, 1, 2], True),  # decode at position 9
        StepItem(list(range(20, 31)), 0, [3, 4, 5], True),  # a whole 11-token prompt
        StepItem(list(range(40, 46)), 5, [6, 7, 8], True),  # a chunk after 5 cached tokens
    ]


def test_compact_logits_equal_transformers_on_a_mixed_step(tiny_model_dir):
    cores = []
    for impl in ("auto", "transformers"):
        config = small_config(tiny_model_dir, blocks=40)
        config.model_impl = impl
        cores.append(build_core(config))
    outputs = []
    for core in cores:
        # the same cached context in both: a first step fills positions 0-8 and 0-4 of two sequences
        core.runner.execute(
            [StepItem(list(range(100, 109)), 0, [0, 1, 2], False), StepItem(list(range(50, 55)), 0, [6, 7, 8], False)]
        )
        outputs.append(core.runner.execute(mixed_step()))
    compact, generic = outputs
    assert compact.shape == generic.shape == (3, generic.shape[1])
    torch.testing.assert_close(compact, generic, rtol=1e-4, atol=1e-4)
    assert compact.argmax(-1).tolist() == generic.argmax(-1).tolist()


def test_int8_quantization_applies_to_the_fused_projections(tiny_model_dir):
    config = small_config(tiny_model_dir, blocks=200)
    config.quantization = "int8"
    core = build_core(config)
    layer = core.runner.model.model.layers[0]
    assert isinstance(core.runner.model, CausalLM)
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear)
    assert isinstance(layer.mlp.gate_up_proj, QuantizedLinear)
    config.model_impl = "transformers"
    generic = build_core(config)
    cases = workload(seed=5, n=6)
    # per-output-channel scales: the fused weight quantizes row by row exactly as the separate ones
    assert run_all(core, cases) == run_all(generic, cases)


@pytest.mark.slow
def test_compiled_layers_give_transformers_greedy_tokens(tiny_model_dir, monkeypatch):
    # steps of more than 8 tokens (the prefill chunks here) run eagerly, smaller ones through the graph
    monkeypatch.setattr(llama, "COMPILED_MAX_TOKENS", 8)
    config = small_config(tiny_model_dir, blocks=200)
    config.compile = True
    core = build_core(config)  # tunes, then compiles and warms up here
    decoder = core.runner.model.model
    compiled = decoder.compiled
    assert compiled is not None
    graph_steps: list[int] = []
    decoder.compiled = lambda layers, h, *rest: graph_steps.append(h.shape[0]) or compiled(layers, h, *rest)
    cases = workload(seed=7, n=8)
    assert run_all(core, cases) == reference(tiny_model_dir, cases)
    assert graph_steps and max(graph_steps) <= 8


def count_skinny_products(monkeypatch) -> list[tuple[int, int]]:
    """The rows and output width of each product the native form computed (None where it does not run)."""
    rows: list[tuple[int, int]] = []
    real = native_attention.skinny_linear

    def counted(x, weight, bias):
        out = real(x, weight, bias)
        if out is not None:
            rows.append((x.shape[0], weight.shape[0]))
        return out

    monkeypatch.setattr(native_attention, "skinny_linear", counted)
    return rows


@pytest.mark.parametrize("form", [TRANSPOSED, ONEDNN, NATIVE])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: projections with a bias
def test_every_step_in_each_product_form_on_one_thread_gives_transformers_greedy_tokens(
    arch, form, tiny_model_dir, tiny_qwen2_dir, monkeypatch
):
    # a form and thread count step tuning may pick for any step size, forced on every step here
    # (prefill chunks, mixed steps, decodes of 1-8 sequences), whatever this machine would time
    model_dir = {"llama": tiny_model_dir, "qwen2": tiny_qwen2_dir}[arch]
    cases = workload(seed=5, n=8)
    config = small_config(model_dir, blocks=200)
    config.step_tuning = "off"
    core = build_core(config)
    model = core.runner.model
    if form == ONEDNN:
        assert model.pack_weights() == len(model.linears())
        model.drop_unpacked_weights()  # what a plan of oneDNN throughout does: nothing else can run now
    core.runner.set_plan(StepPlan.uniform(1, form, limit=4096))
    skinny = count_skinny_products(monkeypatch)
    calls: list[str] = []
    for name in ("mm", "addmm"):
        real = getattr(torch, name)
        torch_patch = patch.object(torch, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
        torch_patch.start()
    try:
        produced = run_all(core, cases)
    finally:
        patch.stopall()
    assert produced == reference(model_dir, cases)
    assert bool(calls) == (form == TRANSPOSED)
    if form == NATIVE and native_attention.skinny_linear_available():  # a CPU without AVX2 runs F.linear
        assert min(skinny)[0] == 1 and max(skinny)[0] > 8  # decodes and whole prompts
    else:
        assert not skinny


@pytest.mark.slow
def test_the_native_form_inside_the_compiled_graph_gives_transformers_greedy_tokens(tiny_model_dir, monkeypatch):
    if not native_attention.skinny_linear_available():
        pytest.skip("this CPU's build has no skinny product (it needs AVX2 and FMA)")
    monkeypatch.setattr(llama, "COMPILED_MAX_TOKENS", 8)
    config = small_config(tiny_model_dir, blocks=200)
    config.step_tuning = "off"
    config.compile = True
    core = build_core(config)
    core.runner.set_plan(StepPlan.uniform(2, NATIVE, limit=4096))
    skinny = count_skinny_products(monkeypatch)  # the graph's operator calls it each step
    cases = workload(seed=13, n=6)
    assert run_all(core, cases) == reference(tiny_model_dir, cases)
    down = core.runner.model.model.layers[0].mlp.down_proj.weight.shape[0]
    assert (1, down) in skinny  # a layer's product inside the graph, not only the LM head's outside it


def test_start_up_tunes_steps_up_to_the_largest_decode_and_off_leaves_the_default(tiny_model_dir, caplog):
    config = small_config(tiny_model_dir, blocks=200)
    with caplog.at_level(logging.INFO, logger="goodput_runtime.engine.step_tuning"):
        tuned = build_core(config)
    assert tuned.runner.plan.limit == config.max_num_seqs
    assert any(r.message.startswith("Step tuning (") and "larger steps" in r.message for r in caplog.records)
    cases = workload(seed=9, n=4)
    assert run_all(tuned, cases) == reference(tiny_model_dir, cases)
    config.step_tuning = "off"
    untuned = build_core(config)
    assert untuned.runner.plan == StepPlan.default(torch.get_num_threads())
    assert not any("packed" in vars(linear) for linear in untuned.runner.model.linears())


def test_steps_run_on_one_thread_while_the_cores_are_contended_and_give_the_same_tokens(tiny_model_dir):
    # the kernel's run-delay counter is given here: it reports the compute threads waiting for a CPU
    # half the time, as when another process takes one of two cores
    config = small_config(tiny_model_dir, blocks=200)
    config.step_tuning = "off"
    core = build_core(config)
    assert core.runner.watch is not None
    waited = [0]
    now = [0.0]

    def read() -> int:
        waited[0] += int(0.5 * 2 * 0.05 * 1e9)  # each read after a step: 50 % of two threads' 50 ms
        return waited[0]

    def clock() -> float:
        now[0] += 0.025  # a read before and one after each step: 50 ms a step
        return now[0]

    core.runner.watch = ContentionWatch(read=read, clock=clock, window=0.2, probe=1000.0)
    core.runner.set_plan(StepPlan.uniform(2, TRANSPOSED, limit=4096))
    threads: list[int] = []
    real = core.runner._forward
    core.runner._forward = lambda *a: threads.append(torch.get_num_threads()) or real(*a)
    cases = workload(seed=11, n=4)
    before = torch.get_num_threads()
    try:
        assert run_all(core, cases) == reference(tiny_model_dir, cases)
    finally:
        torch.set_num_threads(before)
    assert core.runner.watch.contended and threads[:2] == [2, 2] and threads[-1] == 1, threads
    config.cpu_contention = "off"
    assert build_core(config).runner.watch is None
