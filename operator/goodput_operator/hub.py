"""Model configs from the Hugging Face Hub, fetched in the background and cached.

A reconcile asks `lookup()`, which answers at once: a cached config, a cached error,
or None while a fetch is under way. When a fetch ends, the services that asked are
handed to `on_ready` so they reconcile again with the answer.

For one GGUF file of a repository (hf://org/name/file.gguf) the repository's config.json is
used when it has one; otherwise the file's header (its metadata, read from the first
`GGUF_HEADER_BYTES` with an HTTP range request, never the whole file) gives the shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from goodput_contract import gguf
from goodput_operator.capacity import ModelConfig

logger = logging.getLogger(__name__)

GGUF_HEADER_BYTES = 16 * 2**20  # metadata and tensor table; a 150k-token vocabulary takes a few MiB
Key = tuple[str, str, str]  # (repo, revision, GGUF file or "")
Waiter = tuple[str, str]  # (namespace, name) of an InferenceService
TokenSource = Callable[[], Awaitable[str | None]]


@dataclass(frozen=True)
class FetchResult:
    config: ModelConfig | None = None
    error: str | None = None
    fetched_at: float = 0.0


class ConfigFetcher:
    def __init__(
        self,
        endpoint: str,
        timeout_seconds: float = 10.0,
        retry_seconds: float = 60.0,
        on_ready: Callable[[set[Waiter]], None] | None = None,
    ) -> None:
        self._endpoint = endpoint.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._retry_seconds = retry_seconds
        self._on_ready = on_ready
        self._results: dict[Key, FetchResult] = {}
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self._waiters: dict[Key, set[Waiter]] = {}

    def url(self, repo: str, revision: str, file: str = "config.json") -> str:
        return f"{self._endpoint}/{repo}/resolve/{revision}/{file}"

    def lookup(
        self, repo: str, revision: str, token: TokenSource, waiter: Waiter, file: str = ""
    ) -> FetchResult | None:
        """The cached answer; starts a fetch when there is none, or when an error is old enough.
        ``file``: a GGUF file of the repository, sized from config.json or else its own header."""
        key = (repo, revision, file)
        result = self._results.get(key)
        fresh_error = result is not None and time.monotonic() - result.fetched_at < self._retry_seconds
        if result is not None and (result.config is not None or fresh_error):
            return result
        self._waiters.setdefault(key, set()).add(waiter)
        if key not in self._tasks:
            self._tasks[key] = asyncio.create_task(
                self._fetch(key, token), name=f"config {repo}{'/' + file if file else ''}@{revision}"
            )
        return result

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _fetch(self, key: Key, token_source: TokenSource) -> None:
        repo, revision, file = key
        try:
            result = await self._download(repo, revision, token_source, file)
        except Exception as err:  # a failed fetch is an answer, never a crashed task
            result = FetchResult(error=f"{type(err).__name__}: {err}")
        self._results[key] = FetchResult(result.config, result.error, time.monotonic())
        if result.error:
            logger.warning("Fetching config.json of %s@%s failed: %s", repo, revision, result.error)
        else:
            logger.info("Fetched config.json of %s@%s", repo, revision)
        waiters = self._waiters.pop(key, set())
        self._tasks.pop(key, None)
        if self._on_ready and waiters:
            self._on_ready(waiters)

    async def _download(self, repo: str, revision: str, token_source: TokenSource, file: str = "") -> FetchResult:
        token = await token_source()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        url = self.url(repo, revision)
        async with aiohttp.ClientSession(timeout=self._timeout) as session:
            response = await session.get(url, headers=headers)
            async with response:
                if response.status in (401, 403):
                    hint = "the token was refused" if token else "set spec.model.tokenSecretRef"
                    return FetchResult(error=f"HTTP {response.status} from {url} ({hint})")
                if response.status == 404 and file:
                    return await self._gguf_header(session, repo, revision, file, headers)
                if response.status != 200:
                    return FetchResult(error=f"HTTP {response.status} from {url}")
                raw = await response.json(content_type=None)
        try:
            return FetchResult(config=ModelConfig.from_dict(raw))
        except (ValueError, TypeError) as err:
            return FetchResult(error=f"config.json of {repo}: {err}")

    async def _gguf_header(
        self, session: aiohttp.ClientSession, repo: str, revision: str, file: str, headers: dict[str, str]
    ) -> FetchResult:
        """The shape from the GGUF file's own header: its first bytes, by a range request."""
        url = self.url(repo, revision, file)
        ranged = {**headers, "Range": f"bytes=0-{GGUF_HEADER_BYTES - 1}"}
        async with session.get(url, headers=ranged) as response:
            if response.status not in (200, 206):
                return FetchResult(
                    error=f"{repo} has no config.json, and its GGUF file answered HTTP {response.status} from {url}"
                )
            data = await response.content.read(GGUF_HEADER_BYTES)  # a server ignoring Range: stop here
        try:
            header = gguf.read_header(data, f"{repo}/{file}")
            return FetchResult(config=ModelConfig.from_dict(gguf.hf_config(header)))
        except gguf.GGUFError as err:
            return FetchResult(
                error=f"{repo} has no config.json, and the header of {file} cannot be read from "
                f"its first {GGUF_HEADER_BYTES:,} bytes: {err}"
            )
        except (ValueError, TypeError) as err:
            return FetchResult(error=f"the GGUF metadata of {repo}/{file}: {err}")
