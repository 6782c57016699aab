"""What a request id may be, checked the same way at the orchestrator and the stages."""

from __future__ import annotations

from services.mesh.errors import InvalidArgument

MAX_REQUEST_ID = 256


def check_request_id(request_id: str, field: str) -> None:
    if not request_id:
        raise InvalidArgument(f"{field}: must not be empty", field=field)
    if len(request_id) > MAX_REQUEST_ID or not request_id.isprintable():
        raise InvalidArgument(
            f"{field}: expected at most {MAX_REQUEST_ID} printable characters", field=field
        )
