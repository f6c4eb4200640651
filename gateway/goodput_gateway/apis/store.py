"""Stored responses (`store: true`) in the gateway's database: the Batch API's SQLite or PostgreSQL
(`--database`), else an SQLite database in the gateway's memory.

Each row belongs to an owner (the caller's tenant, or a digest of its API key): every read and delete
names the owner, so one caller's ids are unknown to another (404, as an id that never existed).
A row keeps the response object as answered and the conversation up to and including it, as the chat
messages the runtime reads, so `previous_response_id` continues it without reading older rows.
"""

from __future__ import annotations

import json
from typing import Any

from goodput_gateway.batch.db import Database

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS responses (
        id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at BIGINT NOT NULL,
        response TEXT NOT NULL, messages TEXT NOT NULL)""",
)


class ResponseStore:
    def __init__(self, url: str) -> None:
        self.db = Database(url or "sqlite://:memory:", SCHEMA)
        self.shared = bool(url)  # every gateway using the URL sees the same rows

    async def open(self) -> None:
        await self.db.open()

    def close(self) -> None:
        self.db.close()

    async def put(self, owner: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        row = (response["id"], owner, int(response["created_at"]), json.dumps(response), json.dumps(messages))

        def work(db: Database) -> None:
            with db.transaction() as tx:
                tx.execute(
                    "INSERT INTO responses (id, owner, created_at, response, messages) VALUES (?, ?, ?, ?, ?)", row
                )

        await self.db.run(work)

    async def get(self, owner: str, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        def work(db: Database) -> tuple[Any, ...] | None:
            with db.transaction() as tx:
                return tx.one(
                    "SELECT response, messages FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
                )

        row = await self.db.run(work)
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    async def delete(self, owner: str, response_id: str) -> bool:
        def work(db: Database) -> bool:
            with db.transaction() as tx:
                cur = tx.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
                return bool(cur.rowcount)

        return await self.db.run(work)
