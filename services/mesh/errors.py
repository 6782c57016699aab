"""Domain errors carry their gRPC status; one function maps any exception.

Only messages of ``OmniError`` reach clients: anything else is a bug and is
reported as INTERNAL without its text (no paths or stack traces leak out).
"""

from __future__ import annotations

import grpc


class OmniError(Exception):
    """An error a client or operator should see, with its gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidArgument(OmniError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(OmniError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(OmniError):
    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(OmniError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(OmniError):
    code = grpc.StatusCode.NOT_FOUND


class Cancelled(OmniError):
    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(OmniError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class InitFailed(OmniError):
    """A stage could not come up (model fetch, device lock, load)."""

    code = grpc.StatusCode.UNAVAILABLE


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message a client sees for ``exc``."""
    if isinstance(exc, OmniError):
        return exc.code, exc.message
    return grpc.StatusCode.INTERNAL, "internal error (see the server log)"
