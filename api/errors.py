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
    return ApiError(rejection.status, rejection.message, type=rejection.type, code=rejection.code, headers=headers)


def error_response(error: ApiError) -> Response:
    response = Response(json.dumps(error.body()), status=error.status, content_type="application/json")
    for name, value in error.headers.items():
        response.headers[name] = value
    return response


def error_response_for(path: str, error: ApiError) -> Response:
    """`error` in the envelope of the API that `path` belongs to (spec §1.1): Anthropic's on
    /v1/messages*, the Responses API's on /v1/responses*, OpenAI's everywhere else. For code that
    answers before routing (api/security.py, api/health.py), so refusals match the route's API."""
    if path.startswith("/v1/messages"):
        from api.anthropic_translate import error_body as anthropic_body

        body = anthropic_body(error)
    elif path.startswith("/v1/responses"):
        from api.responses_translate import error_body as responses_body

        body = responses_body(error)
    else:
        body = error.body()
    response = Response(json.dumps(body), status=error.status, content_type="application/json")
    for name, value in error.headers.items():
        response.headers[name] = value
    return response
