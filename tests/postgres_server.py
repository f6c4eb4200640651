"""A real PostgreSQL server for the tests: initdb in a temporary directory, a free port, trust auth.

PostgreSQL refuses to run as root, so as root the server runs as `nobody` (runuser). The
binaries are Debian's `postgresql` package (`make postgresql` installs it).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

BIN_DIRS = [Path(p) for p in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)]


def find(binary: str) -> str | None:
    return shutil.which(binary) or next((str(d / binary) for d in BIN_DIRS if (d / binary).exists()), None)


class PostgresServer:
    def __init__(self) -> None:
        # its own directory: pytest's are private to root, which the server user cannot enter
        self.root = Path(tempfile.mkdtemp(prefix="goodput-pg-"))
        self.data = self.root / "data"
        self.process: subprocess.Popen[bytes] | None = None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _as_server_user(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", "nobody", "--", *argv] if os.geteuid() == 0 else argv

    def start(self) -> PostgresServer:
        initdb, postgres = find("initdb"), find("postgres")
        if not initdb or not postgres:
            pytest.fail("PostgreSQL is not installed: run `make postgresql` (Debian's postgresql package)")
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.chown(self.root, nobody.pw_uid, nobody.pw_gid)
        subprocess.run(
            self._as_server_user(
                [initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"]
            ),
            check=True,
            capture_output=True,
        )
        log = (self.root / "server.log").open("wb")
        self.process = subprocess.Popen(
            self._as_server_user(
                [
                    postgres,
                    "-D",
                    str(self.data),
                    "-p",
                    str(self.port),
                    "-h",
                    "127.0.0.1",
                    "-k",
                    str(self.root),
                    "-c",
                    "fsync=off",
                    "-c",
                    "shared_buffers=16MB",
                    "-c",
                    "max_connections=40",
                ]
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        import psycopg

        deadline = time.monotonic() + 30
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return self
            except psycopg.OperationalError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError((self.root / "server.log").read_text()[-2000:]) from None
                time.sleep(0.2)

    def fresh_database(self, name: str) -> str:
        """A new empty database on this server; its URL."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()  # smart shutdown
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)
