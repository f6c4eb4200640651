"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from aiohttp import web


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after, self.headers = retry_after, headers or {}

    def response(self) -> web.Response:
        headers = {**self.headers, **({"Retry-After": str(self.retry_after)} if self.retry_after is not None else {})}
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return web.Response(text=json.dumps(body), status=self.status, content_type="application/json", headers=headers)


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model '{model}' does not exist or you do not have access to it.",
        "invalid_request_error",
        None,
        "model_not_found",
    )


def unavailable(message: str, code: str, retry_after: int = 1) -> APIError:
    return APIError(503, message, "service_unavailable_error", None, code, retry_after)


def too_many(message: str, retry_after: int) -> APIError:
    return APIError(429, message, "rate_limit_error", None, "rate_limit_exceeded", retry_after)
