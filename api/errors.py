"""API errors and the three envelopes they are answered in.

Handlers raise `ApiError`; the app's error handler answers it in the envelope of the API the
path belongs to (`error_response_for`), so no code path answers with an HTML page or a bare 500
for bad input:

* OpenAI (chat, completions, models, admin, anything unknown): `{"error": {"message", "type",
  "param", "code"}}`;
* Anthropic Messages (`/v1/messages*`): `{"type": "error", "error": {"type", "message"}}`, the
  type named after the status;
* OpenAI Responses (`/v1/responses*`): OpenAI's envelope, type `server_error` for a 5xx and
  `invalid_request_error` otherwise.
"""

from __future__ import annotations

import json
from typing import Any

from quart import Response

from actors.messages import Rejected

ANTHROPIC_PREFIX = "/v1/messages"
RESPONSES_PREFIX = "/v1/responses"

_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


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
        """The OpenAI envelope."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def anthropic_error_type(status: int) -> str:
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_error_type(error.status), "message": error.message}}


def responses_error_body(error: ApiError) -> dict[str, Any]:
    kind = "server_error" if error.status >= 500 else "invalid_request_error"
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_rejection(rejection: Rejected) -> ApiError:
    headers = {}
    if rejection.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(rejection.retry_after)))
    return ApiError(rejection.status, rejection.message, type=rejection.type, code=rejection.code, headers=headers)


def error_response_for(path: str, error: ApiError) -> Response:
    """`error` in the envelope of the API that `path` belongs to. Also for code that answers
    before routing (security checks, /health), so refusals match the route's API."""
    if path.startswith(ANTHROPIC_PREFIX):
        body = anthropic_error_body(error)
    elif path.startswith(RESPONSES_PREFIX):
        body = responses_error_body(error)
    else:
        body = error.body()
    response = Response(json.dumps(body), status=error.status, content_type="application/json")
    for name, value in error.headers.items():
        response.headers[name] = value
    return response
