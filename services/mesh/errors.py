"""Domain errors carry their gRPC status; one mapping turns any exception into
what a client sees, whichever way it travels: the status of an RPC
(``abort_rpc``), a stage's in-band ``Error`` (``wire_error``), the
orchestrator's final ``Done`` (``done``) and, after that Done, the status of a
one-request RPC (``end_with``). Both servicers use only these.

Only messages of ``OmniError`` reach clients: anything else is a bug and is
reported as INTERNAL without its text (no paths or stack traces leak out).
"""

from __future__ import annotations

from typing import NoReturn
from urllib.parse import quote

import grpc

from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2


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


class NotServing(Unavailable):
    """The stage serves no request now (draining, not ready, its engine dead) and
    refused this one before any of it ran: another replica may take it."""


class FailedPrecondition(OmniError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(OmniError):
    code = grpc.StatusCode.NOT_FOUND


class Cancelled(OmniError):
    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(OmniError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class EngineDead(OmniError):
    """The engine is gone (a fatal error, not a request's): the stage fails,
    its health turns NOT_SERVING and the process exits so it is restarted."""

    code = grpc.StatusCode.UNAVAILABLE


class InitFailed(OmniError):
    """A stage could not come up (model fetch, device lock, load)."""

    code = grpc.StatusCode.UNAVAILABLE


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """The status, message and offending field a client sees for ``exc``."""
    if isinstance(exc, OmniError):
        return exc.code, exc.message, exc.field
    return grpc.StatusCode.INTERNAL, "internal error (see the server log)", ""


def wire_error(request_id: str, exc: BaseException) -> stage_pb2.Error:
    """``exc`` as a stage's in-band Error: it ends one request, not the stream."""
    code, message, field = to_status(exc)
    return stage_pb2.Error(
        request_id=request_id,
        code=code.value[0],
        code_name=code.name,
        message=message,
        field=field,
        not_serving=isinstance(exc, NotServing),
    )


def done(
    request_id: str, exc: BaseException | None = None, stage: str = ""
) -> orchestrator_pb2.Done:
    """A request's one final event: OK when ``exc`` is None, else its status."""
    if exc is None:
        return orchestrator_pb2.Done(request_id=request_id, code_name="OK")
    code, message, field = to_status(exc)
    return orchestrator_pb2.Done(
        request_id=request_id,
        code=code.value[0],
        code_name=code.name,
        message=message,
        field=field,
        stage=stage,
    )


def forget(exc: BaseException) -> None:
    """Drop what a handled error holds beyond its status: its traceback (every
    frame it passed through, and their locals: a request's inputs, say), its
    context and cause, and those of a group's members. For an error kept, or
    caught in a reference cycle, after it has been turned into a final event."""
    exc.__traceback__ = exc.__context__ = exc.__cause__ = None
    if isinstance(exc, BaseExceptionGroup):
        for member in exc.exceptions:
            forget(member)


def status_code(value: int) -> grpc.StatusCode:
    """The StatusCode of a wire ``code`` (UNKNOWN for a value gRPC does not define)."""
    return _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}


# Trailing metadata values are printable ASCII: anything else (a client's stage
# name in a field path, say) is percent-encoded, and so is "%" itself.
_METADATA_SAFE = "".join(c for c in map(chr, range(0x20, 0x7F)) if not c.isalnum() and c != "%")


def end_with(context: grpc.aio.ServicerContext, final: orchestrator_pb2.Done) -> None:
    """End a one-request RPC (Orchestrator.Generate) with its request's status,
    after its Done event: the Done's code and message, and its ``stage`` and
    ``field`` as trailing metadata, so a proxy or grpcurl sees the failure too."""
    if final.code == 0:
        return
    context.set_code(status_code(final.code))
    context.set_details(final.message)
    context.set_trailing_metadata(
        tuple(
            (key, quote(value, safe=_METADATA_SAFE))
            for key, value in (("stage", final.stage), ("field", final.field))
            if value
        )
    )


async def abort_rpc(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End an RPC with ``exc``'s status (for errors that are not a request's)."""
    code, message, _field = to_status(exc)
    await context.abort(code, message)
    raise AssertionError("context.abort returns only by raising")
