"""The HTTP API's errors: OpenAI's body (`{"error": {"message", "type", "param", "code"}}`) with
the HTTP status that matches the router's gRPC status for the same failure."""

from __future__ import annotations

import json

import grpc

from pdserve.errors import PdserveError, status_for

# gRPC status -> (HTTP status, OpenAI error type)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
RETRY_AFTER_S = 1  # told to a client refused for load (429) or while the pool is down (503)


class ApiError(PdserveError):
    """An error raised by the HTTP layer itself, with its own status and OpenAI `code`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.error_code, self.kind = status, param, code, kind


def error_body(message: str, kind: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def describe(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """HTTP status, body and headers for `exc` (a message of its own, never a traceback)."""
    if isinstance(exc, ApiError):
        status, body = exc.status, error_body(str(exc), exc.kind, exc.param, exc.error_code)
    else:
        code = status_for(exc)
        status, kind = HTTP_STATUS.get(code, (500, "server_error"))
        message = str(exc) if isinstance(exc, PdserveError | ValueError) else "internal error"
        body = error_body(message or code.name.lower(), kind, None, code.name.lower())
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else {}
    return status, body, headers


def sse_error(exc: BaseException) -> str:
    """The one event an error after the stream started becomes (then `[DONE]`)."""
    status, body, _ = describe(exc)
    body["error"]["status"] = status
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
