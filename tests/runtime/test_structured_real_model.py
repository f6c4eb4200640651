"""The guarantee on the real model (SmolLM2-135M-Instruct): at concurrency 16 with n = 4, every
output parses as JSON and validates against its schema (nested objects, arrays, enums, required,
numbers); and LangChain's with_structured_output gets a filled Pydantic model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import openai
import pytest
from helpers import wait_for
from pydantic import BaseModel, Field
from server_thread import ServerThread

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Rome", "Madrid", "Other"]},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
        "landmarks": {
            "type": "array",
            "items": {"type": "string", "enum": ["museum", "tower", "river", "park"]},
            "minItems": 1,
            "maxItems": 2,
        },
        "location": {
            "type": "object",
            "properties": {
                "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                "lon": {"type": "integer", "minimum": -180, "maximum": 180},
            },
            "required": ["lat", "lon"],
        },
    },
    "required": ["city", "population_millions", "landmarks", "location"],
}
CITIES = ["Paris", "Tokyo", "Rome", "Madrid"]


@pytest.fixture(scope="module")
def smollm2_json_server(smollm2_dir: Path):
    running = ServerThread(smollm2_dir, max_model_len=512, kv_cache_memory=96 << 20, max_num_seqs=64)
    running.start(wait_ready=False)
    # loading and warming a real model on a busy shared CPU may take longer than the usual minute
    wait_for(lambda: running.get("/health")[0] == 200, 300, "the server to become ready", every=0.2)
    yield running
    running.stop()


async def test_every_output_validates_at_concurrency_16_with_n_4(smollm2_json_server):
    client = openai.AsyncOpenAI(base_url=f"{smollm2_json_server.url}/v1", api_key="unused", max_retries=0, timeout=1500)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}

    async def one(i: int):
        return await client.chat.completions.create(
            model=smollm2_json_server.model,
            n=4,
            max_tokens=100,
            temperature=0.8,
            seed=i,
            response_format=fmt,
            messages=[{"role": "user", "content": f"Describe {CITIES[i % 4]} as JSON."}],
        )

    results = await asyncio.gather(*(one(i) for i in range(16)))
    choices = [c for r in results for c in r.choices]
    assert len(choices) == 64
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content  # 100 tokens are enough for this schema
        jsonschema.validate(json.loads(choice.message.content), CITY)


class Capital(BaseModel):
    city: str = Field(max_length=20, description="the capital's name")
    country: str = Field(max_length=20)
    is_coastal: bool


def test_langchain_with_structured_output_fills_a_pydantic_model(smollm2_json_server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=smollm2_json_server.model,
        base_url=f"{smollm2_json_server.url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=60,
        max_retries=0,
        timeout=300,
    )
    answer = llm.with_structured_output(Capital).invoke("What is the capital of France?")
    assert isinstance(answer, Capital)
    assert "Paris" in answer.city
