"""An InferenceService's ready replicas (from its EndpointSlices) and the engine's adapter API on each:
/v1/models, /v1/load_lora_adapter, /v1/unload_lora_adapter, with the service's API key."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from goodput_operator.context import Context
from goodput_operator.k8s import ApiError
from goodput_operator.lora_adapter_plan import Replica

MODELS_TIMEOUT_SECONDS = 5.0
LOAD_TIMEOUT_SECONDS = 120.0  # a load reads and checks the adapter's files
SLICE_VERSIONS = ("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1")


async def slice_version(ctx: Context) -> str:
    for version in SLICE_VERSIONS:
        if await ctx.kube.has_resource(version, "endpointslices"):
            return version
    raise ApiError(404, "NotFound", "the server serves no EndpointSlices")


async def ready_replicas(ctx: Context, namespace: str, service: str) -> list[Replica]:
    """The service's ready endpoints, on the port named http (or metrics: the same server)."""
    listing = await ctx.kube.request(
        "GET",
        f"/apis/{await slice_version(ctx)}/namespaces/{namespace}/endpointslices",
        query={"labelSelector": f"kubernetes.io/service-name={service}"},
    )
    replicas: dict[str, Replica] = {}
    for piece in (listing or {}).get("items") or ():
        ports = {p.get("name"): p.get("port") for p in piece.get("ports") or ()}
        port = ports.get("http") or ports.get("metrics")
        for endpoint in piece.get("endpoints") or ():
            state = endpoint.get("conditions") or {}
            if port is None or state.get("terminating") or state.get("ready") is False:
                continue
            host = endpoint["addresses"][0]
            host = f"[{host}]" if ":" in host else host
            name = (endpoint.get("targetRef") or {}).get("name") or f"{host}:{port}"
            replicas[name] = Replica(name, f"http://{host}:{port}")
    return list(replicas.values())


class Engine:
    """The engine's adapter API on each replica, with the service's API key."""

    def __init__(self, session: aiohttp.ClientSession, api_key: str | None) -> None:
        self.session = session
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def adapters(self, replica: Replica) -> set[str]:
        """The adapter names /v1/models lists (entries with a parent)."""
        timeout = aiohttp.ClientTimeout(total=MODELS_TIMEOUT_SECONDS)
        async with self.session.get(f"{replica.url}/v1/models", headers=self.headers, timeout=timeout) as response:
            response.raise_for_status()
            listing = await response.json(content_type=None)
        return {m.get("id") for m in listing.get("data") or () if m.get("parent")}

    async def load(self, replica: Replica, name: str, path: str, pinned: bool, inplace: bool) -> tuple[int, str]:
        body: dict[str, Any] = {"lora_name": name, "lora_path": path}
        if pinned:
            body["pinned"] = True
        if inplace:
            body["load_inplace"] = True
        return await self._post(replica, "/v1/load_lora_adapter", body, LOAD_TIMEOUT_SECONDS)

    async def unload(self, replica: Replica, name: str) -> tuple[int, str]:
        return await self._post(replica, "/v1/unload_lora_adapter", {"lora_name": name}, MODELS_TIMEOUT_SECONDS)

    async def _post(self, replica: Replica, path: str, body: dict[str, Any], seconds: float) -> tuple[int, str]:
        """(HTTP status, the error's message or ""); status 0 when the replica did not answer."""
        try:
            async with self.session.post(
                replica.url + path, json=body, headers=self.headers, timeout=aiohttp.ClientTimeout(total=seconds)
            ) as response:
                text = await response.text()
                if response.status < 400:
                    return response.status, ""
                return response.status, error_message(text)
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            return 0, f"{type(err).__name__}: {err}"


def error_message(text: str) -> str:
    """The message of an error in OpenAI's shape (or vLLM's), else the text itself."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    return text[:500]
