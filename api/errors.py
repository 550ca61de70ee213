"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `ApiError`; the app's error handler turns it (and every HTTP-level error) into
that body, so no code path answers with an HTML page or a bare 500 for bad input.
"""

from __future__ import annotations

import json
from typing import Any

from quart import Response

from actors.messages import Rejected


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_rejection(rejection: Rejected) -> ApiError:
    headers = {}
    if rejection.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(rejection.retry_after)))
    return ApiError(
        rejection.status, rejection.message, type=rejection.type, code=rejection.code, headers=headers
    )


def error_response(error: ApiError) -> Response:
    response = Response(
        json.dumps(error.body()), status=error.status, content_type="application/json"
    )
    for name, value in error.headers.items():
        response.headers[name] = value
    return response
