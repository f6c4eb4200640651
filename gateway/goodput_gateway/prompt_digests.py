"""A prompt's prefix-block digests, as the service's runtimes key their KV blocks, asked of one replica.

The gateway holds no tokenizer or chat template. Rather than fetch and run them (and track each
runtime's salt: the model's identity, revision and KV dtype, and an adapter's weights), it sends the
request's body to one ready replica's ``POST /kv/digests``, which renders and tokenizes the prompt
as its generation route would and answers the digests of its full blocks (docs/kv-cache.md). The
call takes no engine step: a tokenization and one BLAKE2b per block.

Answers are cached per prompt (its messages or prompt and its tools, of one service), so a retry,
a resumed stream and the disaggregated path's estimate ask once. Every call is bounded by
`timeout`; a replica that cannot answer (an older runtime, vLLM, a keyed runtime refusing the
gateway's key, an overloaded one) yields None, and the router falls back to the hash ring.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

APIS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
PROMPT_FIELDS = ("messages", "prompt", "tools", "tool_choice")  # what the prompt's tokens depend on
TIMEOUT_S = 1.0
CACHE_ENTRIES = 4096


@dataclass(frozen=True)
class PromptBlocks:
    block_size: int
    num_tokens: int
    digests: tuple[str, ...]  # one per full block, 32 hex characters each, in order


def cache_key(service: tuple[str, str], path: str, body: Mapping[str, Any], raw: bytes) -> bytes:
    """The prompt's fields of `body`; the whole of `raw` where `body` holds none (a caller that passes the
    bytes alone, such as a resumed stream's continuation)."""
    prompt = {name: body.get(name) for name in PROMPT_FIELDS if name in body}
    data = json.dumps([service, path, prompt], sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.blake2b(data if prompt else data + raw, digest_size=16).digest()


def parse(answer: Any) -> PromptBlocks | None:
    if not isinstance(answer, dict):
        return None
    digests = answer.get("digests")
    block_size, num_tokens = answer.get("block_size"), answer.get("num_tokens")
    if not (isinstance(digests, list) and isinstance(block_size, int) and isinstance(num_tokens, int)):
        return None
    if block_size <= 0 or not all(isinstance(d, str) and len(d) == 32 for d in digests):
        return None
    return PromptBlocks(block_size, num_tokens, tuple(digests))


class PromptDigests:
    def __init__(
        self, session: aiohttp.ClientSession, timeout: float = TIMEOUT_S, entries: int = CACHE_ENTRIES
    ) -> None:
        self.session, self.timeout, self.entries = session, timeout, entries
        self.cache: OrderedDict[bytes, PromptBlocks] = OrderedDict()
        self.calls = 0  # asked of a replica (cache misses), for tests and the bench

    @staticmethod
    def handles(method: str, path: str) -> bool:
        return method == "POST" and path in APIS

    async def of(
        self,
        service: tuple[str, str],
        path: str,
        raw: bytes,
        body: Mapping[str, Any],
        replica: str,
        headers: Mapping[str, str],
    ) -> PromptBlocks | None:
        """The digests of the prompt `raw` (the body as it goes to `path`), from the cache or `replica`."""
        key = cache_key(service, path, body, raw)
        found = self.cache.get(key)
        if found is not None:
            self.cache.move_to_end(key)
            return found
        self.calls += 1
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        sent = {k: v for k, v in headers.items() if k.lower() in ("authorization", "content-type")}
        sent.setdefault("Content-Type", "application/json")
        try:
            async with self.session.post(
                f"{replica}/kv/digests", params={"api": APIS[path]}, data=raw, headers=sent, timeout=timeout
            ) as response:
                if response.status != 200:
                    logger.debug("No digests from %s: %s", replica, response.status)
                    return None
                blocks = parse(await response.json(content_type=None))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as err:
            logger.debug("No digests from %s: %r", replica, err)
            return None
        if blocks is not None:
            self.cache[key] = blocks
            if len(self.cache) > self.entries:
                self.cache.popitem(last=False)
        return blocks
