"""Sizes as people read them, one spelling for every log line and message."""

from __future__ import annotations


def format_bytes(n: float | None) -> str:
    """Decimal units, as download tools show them: "512 B", "1.2 MB"; None is "an
    unknown size"."""
    if n is None:
        return "an unknown size"
    if n < 1000:
        return f"{n:.0f} B"
    size = n / 1000
    for unit in ("KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"
