"""Per-service API keys at the gateway.

A service whose spec names `auth.apiKeySecretRef` takes requests only with one of the keys in
that Secret (`Authorization: Bearer <key>`, compared in constant time), and the gateway sends the
runtime the service's own key in place of the client's header. Secrets are read by name when a
request needs them and kept for `ttl` seconds, so a rotated key is honoured within that time. A
Secret that cannot be read refuses the service's requests (503); it never opens them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from goodput_contract.api_keys import bearer_token, key_matches, split_keys
from goodput_gateway.discovery import Service
from goodput_gateway.errors import APIError, unavailable
from goodput_operator.k8s import ApiError, Kube

logger = logging.getLogger(__name__)
TTL_SECONDS = 30.0


def unauthorized(missing: bool) -> APIError:
    message = (
        "You didn't provide an API key. Send it as a bearer token: 'Authorization: Bearer <key>'"
        if missing
        else "Incorrect API key provided"
    )
    return APIError(401, message, "invalid_request_error", None, "invalid_api_key")


@dataclass
class ServiceKeys:
    kube: Kube | None  # None: no cluster (static services ask for no key)
    ttl: float = TTL_SECONDS
    _cache: dict[tuple[str, str, str], tuple[float, tuple[str, ...]]] = field(default_factory=dict)

    async def keys(self, svc: Service) -> tuple[str, ...]:
        """The service's keys; () for a service that asks for none."""
        if svc.api_key_secret is None or self.kube is None:
            return ()
        name, key = svc.api_key_secret
        cached = self._cache.get((svc.namespace, name, key))
        if cached and cached[0] > time.monotonic():
            return cached[1]
        try:
            value = await self.kube.secret_value(svc.namespace, name, key)
        except ApiError as err:
            logger.warning("Cannot read Secret %s/%s for %s/%s: %s", svc.namespace, name, svc.namespace, svc.name, err)
            value = None
        keys = split_keys([value or ""])
        if not keys:
            raise unavailable(
                f"The API key of '{svc.served_name}' cannot be read (Secret {name}, key {key})", "api_key_unavailable"
            )
        self._cache[(svc.namespace, name, key)] = (time.monotonic() + self.ttl, keys)
        return keys

    async def allowed(self, svc: Service, authorization: str | None) -> bool:
        keys = await self.keys(svc)
        given = bearer_token(authorization)
        return not keys or (given is not None and key_matches(given, keys))

    async def upstream_authorization(self, svc: Service, authorization: str | None) -> str | None:
        """The Authorization header for the runtime, once the client's key is checked (401 otherwise);
        None where the service asks for no key (the client's header then goes through as it came)."""
        keys = await self.keys(svc)
        if not keys:
            return None
        given = bearer_token(authorization)
        if given is None or not key_matches(given, keys):
            raise unauthorized(given is None)
        return f"Bearer {keys[0]}"
