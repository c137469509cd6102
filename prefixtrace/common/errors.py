"""The exception tree of prefixtrace, and its one mapping onto HTTP.

    PrefixtraceError
    ├── InvalidRequest           400  the client sent something we cannot serve
    │   ├── ContextExceedsCapacity 400  prompt + max_tokens can never fit
    │   ├── ForbiddenHost        403  the Host header names no allowed host (proxy/guard.py)
    │   ├── UnsupportedMediaType 415  a POST body that does not say application/json
    │   ├── RequestTooLarge      413  the body is over --max-request-mb (decoded, when compressed)
    │   ├── RequestHeadersTooLarge 431  the request head is over its limit (proxy/connections.py)
    │   ├── RequestTimeout       408  the body did not arrive within --request-body-timeout-s
    │   └── UnsupportedTransferCoding 501  a transfer-coding other than chunked
    ├── ClientGaveUp             499  the client hung up while sending its request
    ├── ModelNotFound            404  the request names a model we do not serve
    ├── UnknownEndpoint          404  no such path here
    │   └── MethodNotAllowed     405  the path exists, for another method
    ├── UpstreamError            502  the upstream server failed or is unreachable
    │   └── UpstreamTimeout      504
    ├── EngineError              500  the embedded engine failed
    │   └── EngineNotReady       503  the model is still loading
    ├── RecorderError            500  the recorder database failed
    └── ServeRefused                  `serve` cannot start as configured (busy port, unwritable --db): CLI only

Library code raises these; only `proxy` turns them into HTTP responses (via
`http_status` and `to_openai_error`) and only `prefixtrace.cli` turns them into
CLI errors.
"""

from __future__ import annotations

from typing import Any


class PrefixtraceError(Exception):
    """Base of every error prefixtrace raises on purpose."""

    code = "internal_error"
    # What a turn records in place of a request body this error left unread or will not keep
    # (proxy/request_limits.py: "[request body not stored: ...]"); None: the body as it came.
    stored_body: str | None = None

    def __init__(self, message: str, **details: Any):
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidRequest(PrefixtraceError):
    code = "invalid_request_error"


class ContextExceedsCapacity(InvalidRequest):
    code = "context_exceeds_capacity"


class ForbiddenHost(InvalidRequest):
    code = "forbidden_host"


class UnsupportedMediaType(InvalidRequest):
    code = "unsupported_media_type"
class RequestTooLarge(InvalidRequest):
    code = "request_too_large"


class RequestHeadersTooLarge(InvalidRequest):
    code = "request_header_fields_too_large"


class RequestTimeout(InvalidRequest):
    code = "request_timeout"


class UnsupportedTransferCoding(InvalidRequest):
    code = "unsupported_transfer_coding"


class ClientGaveUp(PrefixtraceError):
    """Not an answer anyone reads: the status a turn is recorded with."""

    code = "client_disconnected"


class ModelNotFound(PrefixtraceError):
    code = "model_not_found"


class UnknownEndpoint(PrefixtraceError):
    code = "unknown_url"


class MethodNotAllowed(UnknownEndpoint):
    code = "method_not_allowed"


class UpstreamError(PrefixtraceError):
    code = "upstream_error"


class UpstreamTimeout(UpstreamError):
    code = "upstream_timeout"


class EngineError(PrefixtraceError):
    code = "engine_error"


class EngineNotReady(EngineError):
    code = "engine_not_ready"


class RecorderError(PrefixtraceError):
    code = "recorder_error"


class ServeRefused(PrefixtraceError):
    """`serve` cannot start as configured; the message names the fix (prefixtrace/preflight.py)."""

    code = "serve_refused"


# Most specific class first: `http_status` walks the MRO, so a subclass missing
# here falls back to its parent's status rather than to 500.
HTTP_STATUS: dict[type[PrefixtraceError], int] = {
    ContextExceedsCapacity: 400,
    ForbiddenHost: 403,
    UnsupportedMediaType: 415,
    RequestTooLarge: 413,
    RequestHeadersTooLarge: 431,
    RequestTimeout: 408,
    UnsupportedTransferCoding: 501,
    ClientGaveUp: 499,
    InvalidRequest: 400,
    ModelNotFound: 404,
    MethodNotAllowed: 405,
    UnknownEndpoint: 404,
    UpstreamTimeout: 504,
    UpstreamError: 502,
    EngineNotReady: 503,
    EngineError: 500,
    RecorderError: 500,
    PrefixtraceError: 500,
}


def http_status(exc: PrefixtraceError) -> int:
    for cls in type(exc).__mro__:
        if cls in HTTP_STATUS:
            return HTTP_STATUS[cls]
    return 500


def to_openai_error(exc: PrefixtraceError) -> dict[str, Any]:
    """The OpenAI-style error body: {"error": {"message", "type", "code", ...}}."""
    error = {"message": exc.message, "type": exc.code, "code": exc.code}
    error.update(exc.details)
    return {"error": error}
