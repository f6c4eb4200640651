"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from aiohttp import web


class APIError(Exception):
    """An error a client caused or can act on; the server answers it and carries on."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def wrong_type(param: str, expected: str) -> APIError:
    return invalid(f"'{param}' must be {expected}", param, "invalid_type")


def missing(param: str) -> APIError:
    return invalid(f"'{param}' is a required property", param, "missing_required_parameter")


def queue_full(retry_after: int = 1) -> APIError:
    return APIError(
        429,
        "The server's request queue is full; retry later",
        "rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after)},
    )


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "service_unavailable_error", code=code, headers={"Retry-After": "1"})


def internal() -> APIError:
    return APIError(500, "The server had an error while processing your request", "server_error", code="internal_error")


def from_http_exception(exc: web.HTTPException) -> APIError:
    """Routing and transport errors aiohttp raises itself (404, 405, 413), in the same shape."""
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    return APIError(
        exc.status,
        exc.reason if exc.status != 404 else "Not Found: no such route",
        "invalid_request_error",
        code=codes.get(exc.status),
    )
