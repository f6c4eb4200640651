"""Files, batches and their lines in the database: each operation one transaction.

A line is `pending`, `claimed` by one gateway (its owner id) until `lease_until`, or `done`
with its response. A gateway renews the leases of the lines it holds; a gateway that dies
stops renewing and its lines go back to whoever claims next. A result is written only by
the line's current owner, and a line is done once, so each custom_id gets exactly one line
in the batch's output or error file however many gateways come and go.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput_gateway.batch.db import Database, Tx
from goodput_gateway.batch.validate import Line

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")
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
FILE_COLUMNS = ("id", "purpose", "filename", "bytes", "created_at")


def new_id(prefix: str) -> str:
    """Ids that sort by creation time (pagination walks them newest first)."""
    return f"{prefix}{time.time_ns():016x}{secrets.token_hex(4)}"


@dataclass(frozen=True, slots=True)
class Claimed:
    batch_id: str
    idx: int
    custom_id: str
    body: str
    attempts: int


def file_object(row: tuple[Any, ...]) -> dict[str, Any]:
    f = dict(zip(FILE_COLUMNS, row, strict=True))
    return {
        "id": f["id"],
        "object": "file",
        "bytes": f["bytes"],
        "created_at": f["created_at"],
        "filename": f["filename"],
        "purpose": f["purpose"],
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


class Store:
    def __init__(self, db: Database, file_dir: Path | None = None) -> None:
        self.db, self.file_dir = db, file_dir
        if file_dir is not None:
            file_dir.mkdir(parents=True, exist_ok=True)

    # files

    def _put_file(self, tx: Tx, file_id: str, purpose: str, filename: str, data: bytes, now: int) -> None:
        content: bytes | None = data
        path: str | None = None
        if self.file_dir is not None:
            target = self.file_dir / file_id
            temp = target.with_suffix(".part")
            with temp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            temp.replace(target)
            content, path = None, str(target)
        tx.execute(
            "INSERT INTO batch_files (id, purpose, filename, bytes, created_at, content, path) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (file_id, purpose, filename, len(data), now, content, path),
        )

    async def create_file(self, purpose: str, filename: str, data: bytes) -> dict[str, Any]:
        file_id, now = new_id("file-"), int(time.time())

        def work(db: Database) -> None:
            with db.transaction() as tx:
                self._put_file(tx, file_id, purpose, filename, data, now)

        await self.db.run(work)
        return file_object((file_id, purpose, filename, len(data), now))

    async def get_file(self, file_id: str) -> dict[str, Any] | None:
        row = await self.db.run(
            lambda db: _one(db, f"SELECT {', '.join(FILE_COLUMNS)} FROM batch_files WHERE id = ?", (file_id,))
        )
        return None if row is None else file_object(row)

    async def list_files(self, purpose: str | None, after: str | None, limit: int, order: str) -> list[dict]:
        where, params = ["1 = 1"], []
        if purpose:
            where.append("purpose = ?")
            params.append(purpose)
        if after:
            where.append("id < ?" if order == "desc" else "id > ?")
            params.append(after)
        sql = (
            f"SELECT {', '.join(FILE_COLUMNS)} FROM batch_files WHERE {' AND '.join(where)} "
            f"ORDER BY id {'DESC' if order == 'desc' else 'ASC'} LIMIT ?"
        )
        rows = await self.db.run(lambda db: _all(db, sql, (*params, limit)))
        return [file_object(r) for r in rows]

    async def file_content(self, file_id: str) -> bytes | None:
        row = await self.db.run(lambda db: _one(db, "SELECT content, path FROM batch_files WHERE id = ?", (file_id,)))
        if row is None:
            return None
        content, path = row
        if path is not None:
            return Path(path).read_bytes()
        return bytes(content)

    async def delete_file(self, file_id: str) -> bool:
        def work(db: Database) -> str | bool | None:
            with db.transaction() as tx:
                row = tx.one("SELECT path FROM batch_files WHERE id = ?", (file_id,))
                if row is None:
                    return False
                tx.execute("DELETE FROM batch_files WHERE id = ?", (file_id,))
                return row[0]

        found = await self.db.run(work)
        if isinstance(found, str):
            Path(found).unlink(missing_ok=True)
        return found is not False

    # batches

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

    # the dispatcher's side

    async def take_validating(self, owner_lease: float) -> list[tuple[str, str, str]]:
        """(batch id, input file id, endpoint) of batches to validate, leased to the caller."""
        now = time.time()

        def work(db: Database) -> list[tuple[str, str, str]]:
            with db.transaction() as tx:
                rows = tx.all(
                    "SELECT id, input_file_id, endpoint FROM batches WHERE status = 'validating' AND "
                    f"lease_until < ? ORDER BY id LIMIT 4{tx.skip_locked()}",
                    (now,),
                )
                for r in rows:
                    tx.execute("UPDATE batches SET lease_until = ? WHERE id = ?", (now + owner_lease, r[0]))
                return rows

        return await self.db.run(work)

    async def start_batch(self, batch_id: str, model: str, lines: list[Line]) -> bool:
        def work(db: Database) -> bool:
            with db.transaction() as tx:
                updated = tx.execute(
                    "UPDATE batches SET status = 'in_progress', in_progress_at = ?, model = ?, "
                    "total = ?, lease_until = 0 WHERE id = ? AND status = 'validating'",
                    (int(time.time()), model, len(lines), batch_id),
                )
                if updated.rowcount != 1:
                    return False
                tx.many(
                    "INSERT INTO batch_lines (batch_id, idx, custom_id, body, state) VALUES (?, ?, ?, ?, 'pending')",
                    [(batch_id, i, line.custom_id, line.body) for i, line in enumerate(lines)],
                )
                return True

        return await self.db.run(work)

    async def fail_batch(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        def work(db: Database) -> None:
            with db.transaction() as tx:
                tx.execute(
                    "UPDATE batches SET status = 'failed', failed_at = ?, errors = ? "
                    "WHERE id = ? AND status = 'validating'",
                    (int(time.time()), json.dumps(errors), batch_id),
                )

        await self.db.run(work)

    async def running(self) -> list[tuple[str, str, str, int]]:
        """(id, model, endpoint, expires_at) of batches whose lines may be claimed."""
        return await self.db.run(
            lambda db: _all(
                db, "SELECT id, model, endpoint, expires_at FROM batches WHERE status = 'in_progress' ORDER BY id", ()
            )
        )

    async def claim(self, batch_id: str, owner: str, count: int, lease: float) -> list[Claimed]:
        now = time.time()

        def work(db: Database) -> list[Claimed]:
            with db.transaction() as tx:
                # the CTE is evaluated once (PostgreSQL may re-run an IN subquery, taking more than LIMIT)
                rows = tx.all(
                    "WITH picked AS (SELECT idx FROM batch_lines WHERE batch_id = ? AND (state = 'pending' OR "
                    "(state = 'claimed' AND lease_until < ?)) AND EXISTS (SELECT 1 FROM batches WHERE id = ? AND "
                    f"status = 'in_progress') ORDER BY idx LIMIT ?{tx.skip_locked()}) "
                    "UPDATE batch_lines SET state = 'claimed', owner = ?, lease_until = ?, attempts = attempts + 1 "
                    "WHERE batch_id = ? AND idx IN (SELECT idx FROM picked) RETURNING idx, custom_id, body, attempts",
                    (batch_id, now, batch_id, count, owner, now + lease, batch_id),
                )
                return [Claimed(batch_id, *r) for r in sorted(rows)]

        return await self.db.run(work)

    async def renew(self, owner: str, lease: float) -> None:
        def work(db: Database) -> None:
            with db.transaction() as tx:
                tx.execute(
                    "UPDATE batch_lines SET lease_until = ? WHERE owner = ? AND state = 'claimed'",
                    (time.time() + lease, owner),
                )

        await self.db.run(work)

    async def finish_line(
        self,
        line: Claimed,
        owner: str,
        status_code: int | None,
        request_id: str | None,
        response: Any,
        error: dict[str, str] | None,
    ) -> bool:
        """Record a line's result; False when the line is no longer this owner's (its lease ran out)."""

        def work(db: Database) -> bool:
            with db.transaction() as tx:
                updated = tx.execute(
                    "UPDATE batch_lines SET state = 'done', status_code = ?, request_id = ?, "
                    "response = ?, error = ?, owner = NULL WHERE batch_id = ? AND idx = ? AND "
                    "state = 'claimed' AND owner = ?",
                    (
                        status_code,
                        request_id,
                        None if response is None else json.dumps(response),
                        None if error is None else json.dumps(error),
                        line.batch_id,
                        line.idx,
                        owner,
                    ),
                )
                return bool(updated.rowcount == 1)

        return await self.db.run(work)

    async def release(self, line: Claimed, owner: str) -> None:
        """Give a line back to be tried again (by anyone)."""

        def work(db: Database) -> None:
            with db.transaction() as tx:
                tx.execute(
                    "UPDATE batch_lines SET state = 'pending', owner = NULL, lease_until = 0 "
                    "WHERE batch_id = ? AND idx = ? AND state = 'claimed' AND owner = ?",
                    (line.batch_id, line.idx, owner),
                )

        await self.db.run(work)

    async def pending_lines(self) -> dict[str, int]:
        """Lines of running batches not yet done, by the batches' model."""
        rows = await self.db.run(
            lambda db: _all(
                db,
                "SELECT b.model, COUNT(*) FROM batch_lines l JOIN batches b ON b.id = l.batch_id "
                "WHERE l.state <> 'done' AND b.status IN ('in_progress', 'cancelling') GROUP BY b.model",
                (),
            )
        )
        return {model: int(count) for model, count in rows}

    async def to_finalize(self) -> list[tuple[str, str]]:
        """(batch id, final status) of batches with nothing left to run: all lines done (completed), past
        their window (expired), or cancelled with no line in flight. A line claimed by a gateway that died
        is left to run until it is done: its lapsed lease makes it claimable again, never finished."""
        now = time.time()
        sql = (
            "SELECT b.id, b.status, b.expires_at, "
            "(SELECT COUNT(*) FROM batch_lines l WHERE l.batch_id = b.id AND l.state <> 'done'), "
            "(SELECT COUNT(*) FROM batch_lines l WHERE l.batch_id = b.id AND l.state = 'claimed' "
            " AND l.lease_until >= ?) FROM batches b WHERE b.status IN ('in_progress', 'finalizing', 'cancelling') "
            "AND b.lease_until < ?"
        )
        rows = await self.db.run(lambda db: _all(db, sql, (now, now)))
        out = []
        for batch_id, status, expires_at, left, in_flight in rows:
            if status == "cancelling":
                if not in_flight:
                    out.append((batch_id, "cancelled"))
            elif now >= expires_at:
                out.append((batch_id, "expired"))
            elif not left:
                out.append((batch_id, "completed"))
        return out

    async def finalize(self, batch_id: str, final: str, lease: float) -> bool:
        """Write the output and error files and move the batch to `final`; False when another gateway
        does it. Lines not done by now (an expired or cancelled batch) go to the error file."""
        now = int(time.time())

        def begin(db: Database) -> bool:
            with db.transaction() as tx:
                moving = "finalizing" if final == "completed" else "cancelling" if final == "cancelled" else None
                status = (
                    "'in_progress', 'finalizing'"
                    if final == "completed"
                    else "'cancelling'"
                    if final == "cancelled"
                    else "'in_progress', 'finalizing'"
                )
                updated = tx.execute(
                    f"UPDATE batches SET status = ?, finalizing_at = COALESCE(finalizing_at, ?), "
                    f"lease_until = ? WHERE id = ? AND status IN ({status}) AND lease_until < ?",
                    (moving or "finalizing", now, time.time() + lease, batch_id, time.time()),
                )
                return bool(updated.rowcount == 1)

        if not await self.db.run(begin):
            return False

        def write(db: Database) -> bool:
            with db.transaction() as tx:
                code = {"expired": "batch_expired", "cancelled": "batch_cancelled"}.get(final)
                if code is not None:
                    message = f"This request was not run: the batch was {final} first"
                    tx.execute(
                        "UPDATE batch_lines SET state = 'done', owner = NULL, error = ? "
                        "WHERE batch_id = ? AND state <> 'done'",
                        (json.dumps({"code": code, "message": message}), batch_id),
                    )
                rows = tx.all(
                    "SELECT idx, custom_id, status_code, request_id, response, error FROM batch_lines "
                    "WHERE batch_id = ? ORDER BY idx",
                    (batch_id,),
                )
                output: list[str] = []
                errors: list[str] = []
                for idx, custom_id, status_code, request_id, response, error in rows:
                    line = {
                        "id": f"batch_req_{batch_id.removeprefix('batch_')}_{idx}",
                        "custom_id": custom_id,
                        "response": None
                        if status_code is None
                        else {
                            "status_code": status_code,
                            "request_id": request_id or "",
                            "body": json.loads(response) if response else None,
                        },
                        "error": json.loads(error) if error else None,
                    }
                    ok = status_code is not None and 200 <= status_code < 300
                    (output if ok else errors).append(json.dumps(line) + "\n")
                output_id = new_id("file-") if output else None
                error_id = new_id("file-") if errors else None
                stamp = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}[final]
                updated = tx.execute(
                    f"UPDATE batches SET status = ?, {stamp} = ?, output_file_id = ?, "
                    "error_file_id = ?, lease_until = 0 WHERE id = ? AND status IN "
                    "('finalizing', 'cancelling', 'in_progress')",
                    (final, int(time.time()), output_id, error_id, batch_id),
                )
                if updated.rowcount != 1:
                    return False
                if output_id:
                    self._put_file(
                        tx, output_id, "batch_output", f"{batch_id}_output.jsonl", "".join(output).encode(), now
                    )
                if error_id:
                    self._put_file(
                        tx, error_id, "batch_output", f"{batch_id}_error.jsonl", "".join(errors).encode(), now
                    )
                return True

        return await self.db.run(write)


def _one(db: Database, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
    with db.transaction() as tx:
        return tx.one(sql, params)


def _all(db: Database, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    with db.transaction() as tx:
        return tx.all(sql, params)
