"""JSON bodies for the errors hypercorn answers itself, before the app sees a request.

h11 refuses a request line plus headers over hypercorn's `h11_max_incomplete_size` (16 KiB) with
a 431, and malformed HTTP with a 400; hypercorn answers those in `H11Protocol` with an empty
body and `Connection: close`, so no app hook can reach them. `ApiH11Protocol` answers the same
status with a JSON error in the envelope of the API the request line names (OpenAI's when it
cannot be read), still closing the connection.

hypercorn builds its HTTP/1.1 protocol by name inside `hypercorn.protocol.ProtocolWrapper`, with
no setting to choose the class: `install_protocol_errors()` points that name at the subclass
(once per process; it leaves a hypercorn it does not recognise alone).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from itertools import chain

import h11
import hypercorn.protocol
from hypercorn.events import Event, RawData
from hypercorn.protocol.h11 import H11Protocol

from api.errors import ApiError, error_response_for

log = logging.getLogger(__name__)

HEAD_BYTES = 2048  # enough of a request's first bytes to read its path

_ERRORS = {
    431: ApiError(
        431,
        "request line and headers are too large: this server reads at most {limit} bytes of them",
        code="request_header_fields_too_large",
    ),
    400: ApiError(400, "malformed HTTP request", code="bad_http_request"),
}


def request_path(head: bytes) -> str:
    """The path of a request line (`POST /v1/messages HTTP/1.1`), or "" when there is none."""
    line = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) < 2 or not parts[1].startswith(b"/"):
        return ""
    return parts[1].split(b"?", 1)[0].decode("latin-1")


def reason_phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def protocol_error(status: int, limit: int) -> ApiError:
    known = _ERRORS.get(status)
    if known is None:
        return ApiError(status, f"HTTP protocol error {status}", code="http_protocol_error")
    return ApiError(status, known.message.format(limit=limit), type=known.type, code=known.code)


class ApiH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol whose own error answers carry a JSON body."""

    _head = b""  # the first bytes of the request being read (for its path)

    async def handle(self, event: Event) -> None:
        if isinstance(event, RawData) and isinstance(self.connection, h11.Connection):
            if self.connection.their_state is h11.IDLE and len(self._head) < HEAD_BYTES:
                self._head = (self._head + event.data)[:HEAD_BYTES]
        await super().handle(event)

    async def _create_stream(self, request: h11.Request) -> None:
        self._head = b""  # parsed: the next request's bytes start afresh
        await super()._create_stream(request)

    async def _send_error_response(self, status_code: int) -> None:
        error = protocol_error(status_code, self.config.h11_max_incomplete_size)
        response = error_response_for(request_path(self._head), error)
        body = await response.get_data(as_text=False)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await self._send_h11_event(
            h11.Response(
                status_code=status_code,
                headers=list(chain(headers, self.config.response_headers("h11"))),
                reason=reason_phrase(status_code),
            )
        )
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


def install_protocol_errors() -> bool:
    """Have hypercorn build `ApiH11Protocol` for HTTP/1.1 connections; False when it cannot."""
    current = getattr(hypercorn.protocol, "H11Protocol", None)
    if current is ApiH11Protocol:
        return True
    if current is not H11Protocol or not callable(getattr(H11Protocol, "_send_error_response", None)):
        log.warning("unrecognised hypercorn protocol layer: its own 400/431 answers keep an empty body")
        return False
    hypercorn.protocol.H11Protocol = ApiH11Protocol  # type: ignore[misc]
    return True
