"""An input file checked as OpenAI checks it: one JSON object a line, each with a unique
`custom_id`, `method` POST, a `url` this gateway serves and a `body` naming one model for the
whole file. The first bad line is refused with its number (1-based)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from goodput_gateway.errors import APIError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_LINES = 50_000
MAX_FILE_BYTES = 200 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Line:
    custom_id: str
    url: str
    body: str  # the request body, as JSON text


@dataclass(frozen=True, slots=True)
class BatchInput:
    lines: list[Line]
    model: str
    url: str


def line_error(number: int, message: str, code: str = "invalid_batch_line") -> APIError:
    return APIError(400, f"Line {number}: {message}", param="file", code=code)


def parse_input(data: bytes) -> BatchInput:
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise APIError(400, "The batch input file must be UTF-8 text", param="file", code="invalid_file") from None
    lines: list[Line] = []
    seen: set[str] = set()
    model = url = None
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError:
            raise line_error(number, "not valid JSON") from None
        if not isinstance(item, dict):
            raise line_error(number, "must be a JSON object")
        unknown = set(item) - {"custom_id", "method", "url", "body"}
        if unknown:
            raise line_error(number, f"unknown field '{sorted(unknown)[0]}'; a line has custom_id, method, url, body")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise line_error(number, "'custom_id' must be a non-empty string")
        if custom_id in seen:
            raise line_error(
                number,
                f"the custom_id '{custom_id}' is used by an earlier line; each must be unique",
                "duplicate_custom_id",
            )
        seen.add(custom_id)
        if item.get("method") != "POST":
            raise line_error(number, "'method' must be POST")
        line_url = item.get("url")
        if line_url not in ENDPOINTS:
            raise line_error(number, f"'url' must be one of {', '.join(ENDPOINTS)}, got {json.dumps(line_url)}")
        if url is not None and line_url != url:
            raise line_error(number, f"every line must use the same url; an earlier line uses {url}")
        url = line_url
        body = item.get("body")
        if not isinstance(body, dict):
            raise line_error(number, "'body' must be a JSON object")
        line_model = body.get("model")
        if not isinstance(line_model, str) or not line_model:
            raise line_error(number, "'body.model' must be a non-empty string")
        if model is not None and line_model != model:
            raise line_error(
                number, f"every line must name the same model; an earlier line names '{model}'", "mismatched_model"
            )
        model = line_model
        if body.get("stream"):
            raise line_error(number, "'body.stream' is not allowed in a batch")
        lines.append(Line(custom_id, line_url, json.dumps(body)))
        if len(lines) > MAX_LINES:
            raise APIError(
                400,
                f"A batch input file may hold at most {MAX_LINES} requests",
                param="file",
                code="too_many_requests_in_file",
            )
    if not lines or model is None or url is None:
        raise APIError(400, "The batch input file holds no request", param="file", code="empty_file")
    return BatchInput(lines, model, url)
