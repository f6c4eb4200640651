"""A local HTTP server answering the Hugging Face Hub's file-resolve routes, for the runtime's hf://
adapter sources. It stands in for the Hub, which cannot be reached from here: huggingface_hub talks to
it through HF_ENDPOINT as it would to huggingface.co.

``GET|HEAD /{org}/{repo}/resolve/{revision}/{filename}`` answers the file with the headers
huggingface_hub reads (``X-Repo-Commit``, ``ETag``, ``Content-Length``), or the Hub's 404s with their
``X-Error-Code``: ``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``. A revision is ``main`` or
the repository's commit hash. `delay` holds every answer that long (a slow Hub).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class HubStandIn:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.delay = 0.0
        self.requests: list[str] = []  # "METHOD path" of each request, in order
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo: str, directory: Path | None = None, files: dict[str, bytes] | None = None) -> None:
        """Serve repository `repo` with the files of `directory` (and `files` besides)."""
        content = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()} if directory else {}
        content.update(files or {})
        self.repos[repo] = content

    def commit(self, repo: str) -> str:
        digest = hashlib.sha1()
        for name in sorted(self.repos[repo]):
            digest.update(name.encode() + b"\0" + self.repos[repo][name])
        return digest.hexdigest()

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        self.requests.append(f"{handler.command} {handler.path}")
        if self.delay:
            time.sleep(self.delay)
        parts = handler.path.split("?", 1)[0].strip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return self.error(handler, 404, None, "Not found")
        repo, revision, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        files = self.repos.get(repo)
        if files is None:
            return self.error(handler, 404, "RepoNotFound", "Repository not found")
        commit = self.commit(repo)
        if revision not in ("main", commit):
            return self.error(handler, 404, "RevisionNotFound", "Invalid rev id: " + revision)
        data = files.get(filename)
        if data is None:
            return self.error(handler, 404, "EntryNotFound", "Entry not found")
        handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        handler.send_header("X-Repo-Commit", commit)
        handler.end_headers()
        if body:
            handler.wfile.write(data)

    @staticmethod
    def error(handler: BaseHTTPRequestHandler, status: int, code: str | None, message: str) -> None:
        raw = json.dumps({"error": message}).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(raw)))
        if code:
            handler.send_header("X-Error-Code", code)
            handler.send_header("X-Error-Message", message)
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(raw)

    def start(self) -> HubStandIn:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
