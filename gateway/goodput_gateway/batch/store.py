"""Files, batches and their lines in the database: each operation one transaction.

A line is `pending`, `claimed` by one gateway (its owner id) until `lease_until`, or `done`
with its response. A gateway renews the leases of the lines it holds; a gateway that dies
stops renewing and its lines go back to whoever claims next. A result is written only by
the line's current owner, and a line is done once, so each custom_id gets exactly one line
in the batch's output or error file however many gateways come and go.
"""

import json
import time
from dataclasses import dataclass
from typing import Any

from goodput_gateway.batch.batch_table import BatchTable
from goodput_gateway.batch.db import Database
from goodput_gateway.batch.file_store import FileStore, new_id, query_all
from goodput_gateway.batch.validate import Line


@dataclass(frozen=True, slots=True)
class Claimed:
    batch_id: str
    idx: int
    custom_id: str
    body: str
    attempts: int


class Store(FileStore, BatchTable):
    """Files and batches (the API's side), and the lines the dispatchers claim, run and finalize."""

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
            lambda db: query_all(
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
            lambda db: query_all(
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
        rows = await self.db.run(lambda db: query_all(db, sql, (now, now)))
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
