"""Helpers the KV hand-off tests share (test_kv_transfer_*.py): the gateway's two phases over real HTTP.

The prefill phase sends the client's request with ``kv_transfer_params: {"do_remote_decode": true}``,
``max_tokens`` 1, ``stream`` false and ``n`` 1; the decode phase sends the client's request unchanged
but for the returned ``kv_transfer_params``: what a gateway does (docs/disaggregation.md).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import aiohttp


async def post(http: aiohttp.ClientSession, url: str, path: str, body: dict) -> tuple[int, Any]:
    async with http.post(f"{url}{path}", json=body, timeout=aiohttp.ClientTimeout(total=600)) as response:
        raw = await response.read()
        kind = response.headers.get("Content-Type", "")
        if kind.startswith("text/event-stream"):
            return response.status, [b[len(b"data: ") :].decode() for b in raw.split(b"\n\n") if b]
        return response.status, json.loads(raw)


async def prefill(http: aiohttp.ClientSession, url: str, path: str, body: dict) -> dict:
    """The prefill phase: the hand-off fields the prefill runtime answered with."""
    phase = {**body, "max_tokens": 1, "stream": False, "n": 1, "kv_transfer_params": {"do_remote_decode": True}}
    phase.pop("stream_options", None)
    status, answer = await post(http, url, path, phase)
    assert status == 200, answer
    return answer["kv_transfer_params"]


async def disaggregated(http: aiohttp.ClientSession, prefill_url: str, decode_url: str, path: str, body: dict):
    """Both phases: the decode runtime's (status, answer)."""
    params = await prefill(http, prefill_url, path, body)
    return await post(http, decode_url, path, {**body, "kv_transfer_params": params})


def texts(answer: Any) -> list[str]:
    """Each choice's text, from a whole answer or a stream's events."""
    if isinstance(answer, list):
        by_index: dict[int, str] = {}
        for event in answer:
            if event == "[DONE]":
                continue
            for choice in json.loads(event)["choices"]:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                by_index[choice["index"]] = by_index.get(choice["index"], "") + piece
        return [by_index[i] for i in sorted(by_index)]
    return [c.get("text", c.get("message", {}).get("content")) for c in answer["choices"]]


async def debug_state(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(f"{url}/debug/state") as response:
        return await response.json()


async def wait_idle(http: aiohttp.ClientSession, url: str, timeout: float = 60.0) -> dict:
    """/debug/state once every KV block is free, no lease held and no request parked (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        state = await debug_state(http, url)
        kv = state.get("kv_transfer", {})
        idle = state["kv_blocks_free"] == state["kv_blocks_total"] and not kv.get("leases") and not kv.get("parked")
        if idle and state["engine_streams"] == 0:
            return state
        assert time.monotonic() < deadline, f"{url} never returned to idle: {state}"
        await asyncio.sleep(0.1)


async def metric(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels` (0 when none)."""
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total
