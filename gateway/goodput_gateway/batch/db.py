"""The batch store's database: SQLite (embedded, the default) or PostgreSQL (shared by replicas).

Every call runs in one worker thread that owns the connection, so the event loop never
blocks on the disk or the network. SQL is written once with `?` placeholders; PostgreSQL's
driver gets them as `%s`. Claims take rows with ``FOR UPDATE SKIP LOCKED`` on PostgreSQL; on
SQLite a write transaction (``BEGIN IMMEDIATE``) holds the database's one write lock, which
gives the same guarantee: two gateways never take the same row.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS batch_files (
        id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes BIGINT NOT NULL,
        created_at BIGINT NOT NULL, content {blob}, path TEXT)""",
    """CREATE TABLE IF NOT EXISTS batches (
        id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
        completion_window TEXT NOT NULL, status TEXT NOT NULL, model TEXT NOT NULL DEFAULT '',
        created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL, in_progress_at BIGINT, finalizing_at BIGINT,
        completed_at BIGINT, failed_at BIGINT, expired_at BIGINT, cancelling_at BIGINT, cancelled_at BIGINT,
        output_file_id TEXT, error_file_id TEXT, errors TEXT, metadata TEXT,
        total INTEGER NOT NULL DEFAULT 0, lease_until DOUBLE PRECISION NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS batch_lines (
        batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
        state TEXT NOT NULL, owner TEXT, lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 0, status_code INTEGER, request_id TEXT, response TEXT, error TEXT,
        PRIMARY KEY (batch_id, idx))""",
    "CREATE INDEX IF NOT EXISTS batch_lines_state ON batch_lines (batch_id, state)",
)


class Database:
    """`sqlite:///relative.db`, `sqlite:////absolute.db`, `sqlite://:memory:` or `postgresql://...`."""

    def __init__(self, url: str, schema: Sequence[str] = SCHEMA) -> None:
        self.url, self.schema = url, schema
        self.postgres = url.startswith(("postgresql://", "postgres://"))
        if not self.postgres and not url.startswith("sqlite://"):
            raise ValueError(f"--database {url!r}: expected sqlite:///PATH or postgresql://...")
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="batch-db")
        self.conn: Any = None
        self.lock = threading.Lock()

    def _connect(self) -> None:
        if self.postgres:
            import psycopg  # only a PostgreSQL store needs the driver

            self.conn = psycopg.connect(self.url, autocommit=True)
            blob = "BYTEA"
        else:
            path = self.url.removeprefix("sqlite://").removeprefix("/") or ":memory:"
            self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            blob = "BLOB"
        with self.transaction() as tx:
            for statement in self.schema:
                tx.execute(statement.format(blob=blob))

    async def open(self) -> None:
        await self.run(lambda _db: None)

    async def run(self, work: Callable[[Database], T]) -> T:
        """`work(self)` in the database's thread, connecting on the first call."""

        def call() -> T:
            with self.lock:
                if self.conn is None:
                    self._connect()
                try:
                    return work(self)
                except Exception:
                    if self.postgres and (self.conn.closed or self.conn.broken):
                        self.conn = None  # the server restarted or the network dropped: reconnect next call
                    raise

        return await asyncio.get_running_loop().run_in_executor(self.executor, call)

    @contextmanager
    def transaction(self) -> Iterator[Tx]:
        tx = Tx(self)
        tx.execute("BEGIN" if self.postgres else "BEGIN IMMEDIATE")
        try:
            yield tx
        except BaseException:
            tx.execute("ROLLBACK")
            raise
        tx.execute("COMMIT")

    def close(self) -> None:
        def shut() -> None:
            if self.conn is not None:
                self.conn.close()
                self.conn = None

        self.executor.submit(shut).result()
        self.executor.shutdown()


class Tx:
    """Statements of one transaction; rows come back as tuples."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        if self.db.postgres:
            sql = sql.replace("?", "%s")
        return self.db.conn.execute(sql, params)

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self.execute(sql, params).fetchall()]

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        row = self.execute(sql, params).fetchone()
        return None if row is None else tuple(row)

    def skip_locked(self) -> str:
        return " FOR UPDATE SKIP LOCKED" if self.db.postgres else ""

    def many(self, sql: str, rows: list[Sequence[Any]]) -> None:
        if self.db.postgres:
            with self.db.conn.cursor() as cur:
                cur.executemany(sql.replace("?", "%s"), rows)
        else:
            self.db.conn.executemany(sql, rows)
