"""Typed errors that map to gRPC status codes at the server edge (see server.ErrorInterceptor)."""

from __future__ import annotations

import grpc


class PdserveError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(PdserveError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(PdserveError, KeyError):
    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class ResourceExhausted(PdserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(PdserveError):
    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(PdserveError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(PdserveError):
    """No credential, or one nobody issued."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(PdserveError):
    """A known credential not allowed this call (an API key on an internal RPC)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class DataLoss(PdserveError):
    """Bytes that fail their checksum: never served."""

    code = grpc.StatusCode.DATA_LOSS


class AlreadyExists(PdserveError):
    code = grpc.StatusCode.ALREADY_EXISTS


class DeadlineExceeded(PdserveError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, PdserveError):
        return exc.code
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, KeyError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL
