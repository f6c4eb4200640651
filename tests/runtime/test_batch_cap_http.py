"""The batch cap on a real server (the tiny model, real HTTP, the openai SDK): beside an online request
batch sequences pause, and their greedy outputs are the ones they have alone."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
from server_thread import ServerThread

BATCH = {"priority": 1, "ignore_eos": True}
PROMPTS = ["The river bends where", "Seven lanterns in the", "A falcon over quartz"]


class CappedServer(ServerThread):
    """Started as ``--slo-tpot`` would start it, with a target no step can meet: beside an online
    sequence the cap lets no batch sequence step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, slo_tpot=1e-6, **kwargs)
        self.config.slo_tpot = 1e-6


async def batch_texts(client: openai.AsyncOpenAI, max_tokens: int, started: asyncio.Event | None = None) -> list[str]:
    """The batch requests' greedy texts, streamed; `started` is set once each has sent a token."""
    first: set[str] = set()

    async def one(prompt: str) -> str:
        text = ""
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, extra_body=BATCH
        )
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            if text:
                first.add(prompt)
                if started is not None and len(first) == len(PROMPTS):
                    started.set()
        return text

    return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


def test_batch_pauses_beside_an_online_request_and_keeps_its_greedy_output(tiny_model_dir) -> None:
    server = CappedServer(tiny_model_dir, max_model_len=512, kv_cache_memory=4 << 20).start()
    try:
        asyncio.run(scenario(server))
    finally:
        server.stop()


async def scenario(server: CappedServer) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    alone = await batch_texts(client, 160)  # no online work: nothing capped
    assert server.metric("goodput_batch_pauses_total") == 0
    assert server.metric("goodput_batch_running_cap") == server.config.max_num_seqs

    started = asyncio.Event()
    batch = asyncio.create_task(batch_texts(client, 160, started))
    await asyncio.wait_for(started.wait(), 30)  # every batch sequence decoding
    online = await client.completions.create(
        model="tiny", prompt="Online:", max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    assert online.usage is not None and online.usage.completion_tokens == 30
    assert not batch.done()  # it sat out the online request's steps
    assert server.metric("goodput_batch_pauses_total") >= 29 * len(PROMPTS)
    beside = await batch  # and resumed once the online request left
    assert beside == alone
    assert server.metric("goodput_batch_running_cap") == server.config.max_num_seqs
    # the step-time model the cap (and admission) predict with, as /debug/state shows it
    status, state = server.get("/debug/state")
    assert status == 200 and isinstance(state, dict)
    model = state["step_time_model"]
    sizes = {int(n): seconds for n, seconds in model["decode_s_by_size"].items()}
    assert set(sizes) >= {1, len(PROMPTS)}  # the online request alone (the batch paused), the batch alone
    assert all(seconds > 0 for seconds in sizes.values()) and model["per_seq_s"] > 0
