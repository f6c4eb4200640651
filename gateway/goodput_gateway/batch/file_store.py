"""The batch store's files: uploads and the output and error files, their bytes in the database or, with a
file directory, on disk (written whole, then renamed into place)."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

from goodput_gateway.batch.db import Database, Tx

FILE_COLUMNS = ("id", "purpose", "filename", "bytes", "created_at")


def new_id(prefix: str) -> str:
    """Ids that sort by creation time (pagination walks them newest first)."""
    return f"{prefix}{time.time_ns():016x}{secrets.token_hex(4)}"


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


def query_one(db: Database, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
    with db.transaction() as tx:
        return tx.one(sql, params)


def query_all(db: Database, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    with db.transaction() as tx:
        return tx.all(sql, params)


class FileStore:
    def __init__(self, db: Database, file_dir: Path | None = None) -> None:
        self.db, self.file_dir = db, file_dir
        if file_dir is not None:
            file_dir.mkdir(parents=True, exist_ok=True)

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
            lambda db: query_one(db, f"SELECT {', '.join(FILE_COLUMNS)} FROM batch_files WHERE id = ?", (file_id,))
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
        rows = await self.db.run(lambda db: query_all(db, sql, (*params, limit)))
        return [file_object(r) for r in rows]

    async def file_content(self, file_id: str) -> bytes | None:
        row = await self.db.run(
            lambda db: query_one(db, "SELECT content, path FROM batch_files WHERE id = ?", (file_id,))
        )
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
