"""Stand-ins for the operator's Context and Kube in unit tests: they record the status writes and
Events a pass sends, and remember what a real Context remembers between passes."""

from __future__ import annotations

from typing import Any

from goodput_operator.node_caches import NodeCaches


class FakeKube:
    def __init__(self) -> None:
        self.statuses: list[dict[str, Any]] = []

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.statuses.append(status)


class FakeContext:
    def __init__(self) -> None:
        self.kube = FakeKube()
        self.events: list[tuple[str, str, str]] = []  # (type, reason, message)
        self.reported_failures: dict[tuple[str, str], tuple[str, ...]] = {}
        self.node_caches = NodeCaches()

    async def event(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))
