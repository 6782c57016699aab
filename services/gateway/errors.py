"""Errors as OpenAI's clients expect them: ``{"error": {"message", "type",
"param", "code"}}`` with an HTTP status. Whatever the mesh answers (a request's
Done, an RPC's status) becomes one through ``http_status``, the one mapping
from a gRPC code to HTTP; ``param`` names the request's own field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

from services.mesh.errors import status_code
from services.mesh.pb.omni.v1 import orchestrator_pb2

Code = grpc.StatusCode

_HTTP = {
    Code.INVALID_ARGUMENT: 400,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.NOT_FOUND: 404,
    Code.DEADLINE_EXCEEDED: 504,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.UNAVAILABLE: 503,
}
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def http_status(code: grpc.StatusCode, field: str = "") -> int:
    """The HTTP status of a gRPC code. RESOURCE_EXHAUSTED is 429 for capacity (a
    full stage names the request id, or nothing) and 413 for a size (the mesh
    names the input that is too large); codes without a match are 500."""
    if code == Code.RESOURCE_EXHAUSTED and field not in ("", "request_id"):
        return 413
    return _HTTP.get(code, 500)


class ApiError(Exception):
    """An error response: HTTP status, message, the offending request field."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def from_grpc(
        cls,
        code: grpc.StatusCode,
        message: str,
        field: str = "",
        params: Mapping[str, str] | None = None,
    ) -> ApiError:
        """The mesh's answer; ``params`` maps the mesh's field paths (prefixes) to
        the request's own field names."""
        return cls(
            http_status(code, field),
            message,
            param=api_param(field, params or {}) or None,
            code=code.name.lower(),
        )

    @classmethod
    def from_done(
        cls, done: orchestrator_pb2.Done, params: Mapping[str, str] | None = None
    ) -> ApiError:
        return cls.from_grpc(status_code(done.code), done.message, done.field, params)

    @classmethod
    def from_rpc(cls, error: grpc.aio.AioRpcError) -> ApiError:
        """An RPC that failed without a Done (authentication, the orchestrator gone)."""
        return cls.from_grpc(error.code(), error.details() or error.code().name)

    @property
    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code or None,
            }
        }


def api_param(field: str, params: Mapping[str, str]) -> str:
    """The request's field for the mesh's ``field``: the longest mapped prefix
    (``params.temperature`` -> ``temperature``), else the mesh's path as it is."""
    for prefix in sorted(params, key=len, reverse=True):
        if field == prefix or field.startswith((f"{prefix}.", f"{prefix}[")):
            return params[prefix]
    return field
