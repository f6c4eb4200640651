"""The Authorization the gateway's calls of its own to a replica carry (its KV-index subscription, and the
load scraper's /v1/models, where a replica lists the LoRA adapters it has loaded): each replica's own
service's runtime key.

A service with ``auth.apiKeySecretRef`` runs runtimes that ask every request but /health and
/metrics for its key, ``GET /kv/events`` included. Proxied requests carry the first key of the
service's Secret (auth.py); the index's subscription to each of the service's replicas carries the
same one, read through the same cache, so a rotated key is used from the next subscription. A
replica of a service that asks for no key, or whose Secret cannot be read, is subscribed to without
one (the latter then answers 401 and is retried, as any subscription that fails).
"""

from __future__ import annotations

import logging

from goodput_gateway.auth import ServiceKeys
from goodput_gateway.discovery import Registry, Service
from goodput_gateway.errors import APIError

logger = logging.getLogger(__name__)


class ReplicaKeys:
    """Called with a replica's base URL, answers the Authorization header its runtime asks for."""

    def __init__(self, keys: ServiceKeys) -> None:
        self.keys = keys
        self.services: dict[str, Service] = {}  # replica URL -> its service, as of the last `learn`

    def learn(self, registry: Registry) -> set[str]:
        """Every service's ready replicas (their URLs), each remembered with its service."""
        self.services = {url: registry.services[key] for key in list(registry.services) for url in registry.ready(key)}
        return set(self.services)

    async def __call__(self, url: str) -> str | None:
        svc = self.services.get(url)
        if svc is None or svc.api_key_secret is None:
            return None
        try:
            keys = await self.keys.keys(svc)
        except APIError as err:
            logger.warning("%s is asked without its service's key (KV events, /v1/models): %s", url, err.message)
            return None
        return f"Bearer {keys[0]}" if keys else None
