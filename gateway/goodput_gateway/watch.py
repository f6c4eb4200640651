"""Tables of one kind's objects kept current from the API server: `Watch` lists, then watches.

A `Watch` runs in a daemon thread (the Kubernetes client blocks) and hands the listing and
each change after it to the event loop, where a `Table` holds what a body means to the
gateway by (namespace, name). The services, their EndpointSlices and the pipelines are three
such tables.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from goodput_operator.k8s import ApiError, Kube

logger = logging.getLogger(__name__)
WATCH_SECONDS = 55
RETRY_SECONDS = 1.0

Key = tuple[str, str]  # (namespace, name)
V = TypeVar("V")


def key_of(body: dict[str, Any]) -> Key:
    meta = body.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


class Table(Mapping[Key, V], Generic[V]):
    """What `read` makes of each object of a kind, by (namespace, name); `read` answers None for an
    object the gateway does not serve. `changed` is called after every listing and event."""

    def __init__(self, read: Callable[[dict[str, Any]], V | None], changed: Callable[[], None] = lambda: None) -> None:
        self._read, self._changed = read, changed
        self._items: dict[Key, V] = {}
        self.synced = False  # listed at least once

    def __getitem__(self, key: Key) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def reset(self, bodies: list[dict[str, Any]]) -> None:
        """A listing: the table holds these objects and no others."""
        self._items = {}
        for body in bodies:
            self._put(body)
        self.synced = True
        self._changed()

    def event(self, kind: str, body: dict[str, Any]) -> None:
        """A watch event after the listing: ADDED, MODIFIED or DELETED."""
        if kind == "DELETED":
            self._items.pop(key_of(body), None)
        else:
            self._put(body)
        self._changed()

    def fill(self, items: dict[Key, V]) -> None:
        """A fixed table, outside any cluster."""
        self._items = dict(items)
        self.synced = True
        self._changed()

    def _put(self, body: dict[str, Any]) -> None:
        key, value = key_of(body), self._read(body)
        if value is None:
            self._items.pop(key, None)
        else:
            self._items[key] = value


class Watch:
    """List, then watch from the list's resourceVersion; on any failure list again. In a daemon thread."""

    def __init__(
        self, kube: Kube, path: str, selector: str, table: Table[Any], loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self.kube, self.path, self.selector, self.table = kube, path, selector, table
        self.loop = loop or asyncio.get_running_loop()
        self.stopping = threading.Event()

    def start(self) -> Watch:
        threading.Thread(target=self._run, daemon=True, name=f"watch {self.path}").start()
        return self

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                query = {"labelSelector": self.selector} if self.selector else {}
                listing = self.kube._call("GET", self.path, query=query)
                self.loop.call_soon_threadsafe(self.table.reset, list(listing.get("items") or ()))
                self._watch(listing["metadata"]["resourceVersion"])
            except Exception as err:
                if self.stopping.is_set():
                    return
                logger.warning("Watching %s failed, listing again: %s", self.path, err)
                time.sleep(RETRY_SECONDS)

    def _watch(self, version: str) -> None:
        api = self.kube._api
        while not self.stopping.is_set():
            query = [
                ("watch", "true"),
                ("resourceVersion", version),
                ("allowWatchBookmarks", "true"),
                ("timeoutSeconds", str(WATCH_SECONDS)),
            ]
            if self.selector:
                query.append(("labelSelector", self.selector))
            request = api.param_serialize(
                "GET",
                self.path,
                query_params=query,
                header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"],
            )
            response = api.call_api(*request, _request_timeout=(10, WATCH_SECONDS + 10))
            if response.status != 200:
                raise ApiError(response.status, response.reason or "", response.read().decode(errors="replace"))
            for line in response.response:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, body = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiError(int(body.get("code") or 0), body.get("reason") or "", json.dumps(body))
                version = (body.get("metadata") or {}).get("resourceVersion") or version
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.loop.call_soon_threadsafe(self.table.event, kind, body)
            response.response.release_conn()
