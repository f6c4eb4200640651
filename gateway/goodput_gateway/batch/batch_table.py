"""The batch store's batches as the API sees them: created, read (with their request counts), listed newest
first, cancelled."""

from __future__ import annotations

import json
import time
from typing import Any

from goodput_gateway.batch.db import Database, Tx
from goodput_gateway.batch.file_store import new_id

BATCH_COLUMNS = (
    "id",
    "endpoint",
    "input_file_id",
    "completion_window",
    "status",
    "model",
    "created_at",
    "expires_at",
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
    "output_file_id",
    "error_file_id",
    "errors",
    "metadata",
    "total",
)


class BatchTable:
    db: Database

    async def create_batch(
        self, endpoint: str, input_file_id: str, window: str, metadata: dict[str, str] | None
    ) -> str:
        batch_id, now = new_id("batch_"), int(time.time())

        def work(db: Database) -> None:
            with db.transaction() as tx:
                tx.execute(
                    "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, "
                    "expires_at, metadata) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?)",
                    (
                        batch_id,
                        endpoint,
                        input_file_id,
                        window,
                        now,
                        now + 24 * 3600,
                        None if metadata is None else json.dumps(metadata),
                    ),
                )

        await self.db.run(work)
        return batch_id

    async def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        def work(db: Database) -> dict[str, Any] | None:
            with db.transaction() as tx:
                return self._batch(tx, batch_id)

        return await self.db.run(work)

    def _batch(self, tx: Tx, batch_id: str) -> dict[str, Any] | None:
        row = tx.one(f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches WHERE id = ?", (batch_id,))
        if row is None:
            return None
        b = dict(zip(BATCH_COLUMNS, row, strict=True))
        counts = dict(
            tx.all(
                "SELECT CASE WHEN status_code BETWEEN 200 AND 299 THEN 'completed' ELSE 'failed' END, "
                "COUNT(*) FROM batch_lines WHERE batch_id = ? AND state = 'done' GROUP BY 1",
                (batch_id,),
            )
        )
        errors = json.loads(b.pop("errors")) if b["errors"] else None
        return {
            "id": b.pop("id"),
            "object": "batch",
            **b,
            "model": b["model"] or None,
            "errors": None if errors is None else {"object": "list", "data": errors},
            "metadata": json.loads(b["metadata"]) if b["metadata"] else None,
            "request_counts": {
                "total": b.pop("total"),
                "completed": counts.get("completed", 0),
                "failed": counts.get("failed", 0),
            },
        }

    async def list_batches(self, after: str | None, limit: int) -> list[dict[str, Any]]:
        def work(db: Database) -> list[dict[str, Any]]:
            with db.transaction() as tx:
                ids = tx.all(
                    "SELECT id FROM batches WHERE id < ? ORDER BY id DESC LIMIT ?", (after or "batch_~", limit)
                )
                return [b for (i,) in ids if (b := self._batch(tx, i)) is not None]

        return await self.db.run(work)

    async def cancel_batch(self, batch_id: str) -> str | None:
        """The status after asking: cancelling (or the status it already had); None: no such batch."""

        def work(db: Database) -> str | None:
            with db.transaction() as tx:
                row = tx.one("SELECT status FROM batches WHERE id = ?", (batch_id,))
                if row is None:
                    return None
                if row[0] in ("validating", "in_progress"):
                    tx.execute(
                        "UPDATE batches SET status = 'cancelling', cancelling_at = ?, lease_until = 0 WHERE id = ?",
                        (int(time.time()), batch_id),
                    )
                    return "cancelling"
                return str(row[0])

        return await self.db.run(work)
