"""OpenAI's Files and Batches routes: what `client.files.*` and `client.batches.*` call."""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from goodput_gateway.batch.store import Store
from goodput_gateway.batch.validate import ENDPOINTS, MAX_FILE_BYTES, parse_input
from goodput_gateway.errors import APIError, invalid

FILE_FIELDS = frozenset({"file", "purpose"})
BATCH_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata"})
ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def not_found(kind: str, ident: str) -> APIError:
    return APIError(404, f"No such {kind}: '{ident}'", param="id", code="not_found")


def int_query(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise invalid(f"'{name}' must be an integer, got '{raw}'", name, "invalid_type") from None
    if not low <= value <= high:
        raise invalid(f"'{name}' must be between {low} and {high}, got {value}", name)
    return value


def reject_unknown_query(request: web.Request, known: set[str]) -> None:
    for name in request.query:
        if name not in known:
            raise invalid(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    shown = data[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(data) > limit,
    }


def path_id(request: web.Request, kind: str) -> str:
    ident = request.match_info["id"]
    if not ID.match(ident):
        raise not_found(kind, ident)
    return ident


class BatchAPI:
    def __init__(self, store: Store, woken: Any) -> None:
        self.store, self.woken = store, woken  # woken(): the dispatcher looks for work now

    # files

    async def create_file(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise invalid(
                "Upload the file as multipart/form-data with the fields 'file' and 'purpose'",
                "file",
                "invalid_content_type",
            )
        fields: dict[str, str] = {}
        data, filename = None, "input.jsonl"
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            name = getattr(part, "name", None) or ""
            if name not in FILE_FIELDS:
                raise invalid(f"'{name}' is not supported by this server", name, "unsupported_parameter")
            if name == "file":
                filename = getattr(part, "filename", None) or filename
                data = bytes(await part.read(decode=False))  # type: ignore[union-attr]
                if len(data) > MAX_FILE_BYTES:
                    raise APIError(
                        413, f"A file may hold at most {MAX_FILE_BYTES} bytes", param="file", code="file_too_large"
                    )
            else:
                fields[name] = await part.text()  # type: ignore[union-attr]
        purpose = fields.get("purpose")
        if purpose is None:
            raise invalid("'purpose' is a required property", "purpose", "missing_required_parameter")
        if purpose != "batch":
            raise invalid(f"'purpose' must be 'batch' at this server, got '{purpose}'", "purpose")
        if data is None:
            raise invalid("'file' is a required property", "file", "missing_required_parameter")
        parse_input(data)  # a bad line is refused now, with its number
        return web.json_response(await self.store.create_file(purpose, filename, data))

    async def list_files(self, request: web.Request) -> web.Response:
        reject_unknown_query(request, {"purpose", "limit", "after", "order"})
        limit = int_query(request, "limit", 10000, 1, 10000)
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid(f"'order' must be 'asc' or 'desc', got '{order}'", "order")
        data = await self.store.list_files(request.query.get("purpose"), request.query.get("after"), limit + 1, order)
        return web.json_response(page(data, limit))

    async def get_file(self, request: web.Request) -> web.Response:
        file_id = path_id(request, "file")
        found = await self.store.get_file(file_id)
        if found is None:
            raise not_found("file", file_id)
        return web.json_response(found)

    async def file_content(self, request: web.Request) -> web.Response:
        file_id = path_id(request, "file")
        content = await self.store.file_content(file_id)
        if content is None:
            raise not_found("file", file_id)
        return web.Response(body=content, content_type="application/octet-stream")

    async def delete_file(self, request: web.Request) -> web.Response:
        file_id = path_id(request, "file")
        if not await self.store.delete_file(file_id):
            raise not_found("file", file_id)
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    # batches

    async def create_batch(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError:
            raise APIError(400, "We could not parse the JSON body of your request.", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "The request body must be a JSON object", code="invalid_type")
        for name in body:
            if name not in BATCH_FIELDS:
                raise invalid(f"'{name}' is not supported by this server", name, "unsupported_parameter")
        for name in ("input_file_id", "endpoint", "completion_window"):
            if name not in body:
                raise invalid(f"'{name}' is a required property", name, "missing_required_parameter")
        endpoint = body["endpoint"]
        if endpoint not in ENDPOINTS:
            raise invalid(f"'endpoint' must be one of {', '.join(ENDPOINTS)}, got {json.dumps(endpoint)}", "endpoint")
        if body["completion_window"] != "24h":
            raise invalid(
                f"'completion_window' must be '24h', got {json.dumps(body['completion_window'])}", "completion_window"
            )
        metadata = body.get("metadata")
        if metadata is not None:
            check_metadata(metadata)
        input_file_id = body["input_file_id"]
        found = await self.store.get_file(input_file_id) if isinstance(input_file_id, str) else None
        if found is None:
            raise invalid(f"No such file: {json.dumps(input_file_id)}", "input_file_id", "not_found")
        if found["purpose"] != "batch":
            raise invalid(f"The file '{input_file_id}' has purpose '{found['purpose']}', not 'batch'", "input_file_id")
        batch_id = await self.store.create_batch(endpoint, input_file_id, "24h", metadata)
        self.woken()
        return web.json_response(await self.store.get_batch(batch_id))

    async def list_batches(self, request: web.Request) -> web.Response:
        reject_unknown_query(request, {"limit", "after"})
        limit = int_query(request, "limit", 20, 1, 100)
        data = await self.store.list_batches(request.query.get("after"), limit + 1)
        return web.json_response(page(data, limit))

    async def get_batch(self, request: web.Request) -> web.Response:
        batch_id = path_id(request, "batch")
        found = await self.store.get_batch(batch_id)
        if found is None:
            raise not_found("batch", batch_id)
        return web.json_response(found)

    async def cancel_batch(self, request: web.Request) -> web.Response:
        batch_id = path_id(request, "batch")
        status = await self.store.cancel_batch(batch_id)
        if status is None:
            raise not_found("batch", batch_id)
        if status not in ("cancelling", "cancelled"):
            raise APIError(
                409, f"Cannot cancel a batch with status '{status}'", param="id", code="batch_not_cancellable"
            )
        self.woken()
        return web.json_response(await self.store.get_batch(batch_id))


def check_metadata(metadata: Any) -> None:
    if not isinstance(metadata, dict):
        raise invalid("'metadata' must be an object of strings", "metadata", "invalid_type")
    if len(metadata) > 16:
        raise invalid("'metadata' may hold at most 16 keys", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise invalid(
                f"'metadata.{key[:64]}': keys are at most 64 characters, values strings of at most 512",
                f"metadata.{key[:64]}",
            )


def add_routes(app: web.Application, api: BatchAPI) -> None:
    app.router.add_post("/v1/files", api.create_file)
    app.router.add_get("/v1/files", api.list_files)
    app.router.add_get("/v1/files/{id}", api.get_file)
    app.router.add_get("/v1/files/{id}/content", api.file_content)
    app.router.add_delete("/v1/files/{id}", api.delete_file)
    app.router.add_post("/v1/batches", api.create_batch)
    app.router.add_get("/v1/batches", api.list_batches)
    app.router.add_get("/v1/batches/{id}", api.get_batch)
    app.router.add_post("/v1/batches/{id}/cancel", api.cancel_batch)
