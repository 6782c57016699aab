"""The media types a chat message's parts may carry, how a file's type is told,
and the one refusal of a kind a stage does not take.

One table for every side: the stage refuses a type it does not list (a typo
such as "image/pgn" is caught at the door, not deep in a model's processor);
the CLI and the gateway name a file's or a data URL's type the same way. The
stage refuses a part of a kind its engine does not take, and the orchestrator,
knowing the entry stage's ``accepts`` from its Describe, refuses it in the same
words before sending the media on.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Protocol

from services.mesh.errors import InvalidArgument

PCM = "audio/pcm"  # audio as float32 samples (Media.pcm), not as a file

MEDIA_TYPES: dict[str, frozenset[str]] = {
    "image": frozenset({"image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp"}),
    "audio": frozenset({"audio/wav", "audio/mpeg", "audio/flac", "audio/ogg", PCM}),
    "video": frozenset({"video/mp4", "video/webm", "video/quicktime"}),
}

_SUFFIXES = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".webp": "image/webp",
    ".gif": "image/gif",
    ".bmp": "image/bmp",
    ".wav": "audio/wav",
    ".mp3": "audio/mpeg",
    ".flac": "audio/flac",
    ".ogg": "audio/ogg",
    ".mp4": "video/mp4",
    ".webm": "video/webm",
    ".mov": "video/quicktime",
}
# Aliases that clients send for the types above.
_ALIASES = {"image/jpg": "image/jpeg", "audio/x-wav": "audio/wav", "audio/wave": "audio/wav",
            "audio/mp3": "audio/mpeg", "audio/x-flac": "audio/flac"}  # fmt: skip


def kind_of(media_type: str) -> str | None:
    """ "image", "audio" or "video" for a type in the table, else None."""
    for kind, types in MEDIA_TYPES.items():
        if media_type in types:
            return kind
    return None


def canonical(media_type: str) -> str:
    """``media_type`` lower-cased, parameters dropped, aliases resolved."""
    bare = media_type.split(";", 1)[0].strip().lower()
    return _ALIASES.get(bare, bare)


def sniff(data: bytes) -> str | None:
    """The media type the file's first bytes say, for the formats in the table."""
    head = data[:16]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "image/webp"
    if head.startswith(b"RIFF") and head[8:12] == b"WAVE":
        return "audio/wav"
    if head.startswith(b"BM"):
        return "image/bmp"
    if head.startswith(b"ID3") or head[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2"):
        return "audio/mpeg"
    if head.startswith(b"fLaC"):
        return "audio/flac"
    if head.startswith(b"OggS"):
        return "audio/ogg"
    if head[4:8] == b"ftyp":
        return "video/quicktime" if head[8:10] == b"qt" else "video/mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "video/webm"
    return None


def of_file(path: Path, data: bytes) -> str | None:
    """A file's media type: its magic bytes, else its suffix; None when neither is known."""
    return sniff(data) or _SUFFIXES.get(path.suffix.lower())


_KIND_ORDER = ("text", "image", "audio", "video")


class _Part(Protocol):
    def WhichOneof(self, oneof: str) -> str | None: ...


class _Message(Protocol):
    @property
    def parts(self) -> Iterable[_Part]: ...


def listed(kinds: Collection[str]) -> str:
    """ "text", "text and image", "text, image and audio"."""
    names = [k for k in _KIND_ORDER if k in kinds] + sorted(set(kinds) - set(_KIND_ORDER))
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def refuse_kinds(
    messages: Iterable[_Message], accepts: Collection[str], stage: str, prefix: str = "inputs"
) -> None:
    """INVALID_ARGUMENT for the first part of a kind ``stage`` does not take:
    "stage thinker takes text and image, not audio", naming the part's field."""
    for m, message in enumerate(messages):
        for p, part in enumerate(message.parts):
            kind = part.WhichOneof("kind")
            if kind is not None and kind not in accepts:
                where = f"{prefix}.messages[{m}].parts[{p}].{kind}"
                raise InvalidArgument(
                    f"{where}: stage {stage} takes {listed(accepts)}, not {kind}", field=where
                )
