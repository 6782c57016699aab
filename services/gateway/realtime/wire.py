"""The server events of a session, built in one place (GA names and shapes)."""

from __future__ import annotations

from typing import Any

from services.gateway.errors import ApiError


def error(failure: ApiError, event_id: str | None = None) -> dict[str, Any]:
    """``error``: its ``param`` names the offending field; ``event_id`` the client's event."""
    body = failure.body["error"]
    return {"type": "error", "error": {**body, "event_id": event_id}}


def response(
    response_id: str,
    status: str,
    *,
    details: dict[str, Any] | None = None,
    output: list[dict[str, Any]] | None = None,
    usage: dict[str, Any] | None = None,
    modalities: list[str],
    voice: str,
    max_output_tokens: int | str,
    metadata: dict[str, str] | None,
) -> dict[str, Any]:
    """A ``realtime.response``, with ``status_details`` always present (null while
    in progress): some clients read it on every response event."""
    return {
        "object": "realtime.response",
        "id": response_id,
        "status": status,
        "status_details": details,
        "output": output or [],
        "conversation_id": "auto",
        "output_modalities": modalities,
        "max_output_tokens": max_output_tokens,
        "audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": voice}},
        "usage": usage,
        "metadata": metadata,
    }


def usage(input_tokens: int, output_tokens: int, *, audio_in: bool, speaks: bool) -> dict[str, Any]:
    kind_in = "audio_tokens" if audio_in else "text_tokens"
    kind_out = "audio_tokens" if speaks else "text_tokens"
    return {
        "total_tokens": input_tokens + output_tokens,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_token_details": {
            "text_tokens": 0,
            "audio_tokens": 0,
            "image_tokens": 0,
            "cached_tokens": 0,
            kind_in: input_tokens,
        },
        "output_token_details": {"text_tokens": 0, "audio_tokens": 0, kind_out: output_tokens},
    }
