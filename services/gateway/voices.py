"""Voice names as OpenAI's apps send them: a table of aliases in front of the
speech stage's own voices. By default every OpenAI voice name (``alloy``,
``marin``, …) is the stage's default voice, so an app written for OpenAI speaks
unchanged; ``--voice-alias NAME=VOICE`` points a name at a voice the stage
offers (``NAME=`` at its default). Any other name goes to the stage as it is,
and the stage refuses one it lacks, naming the voices it offers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# OpenAI's voices across its speech and realtime models.
OPENAI_VOICES = (
    "alloy", "ash", "ballad", "cedar", "coral", "echo", "fable",
    "marin", "nova", "onyx", "sage", "shimmer", "verse",
)  # fmt: skip
DEFAULT = ""  # an alias of the stage's default voice: no voice is asked for


class Voices:
    def __init__(self, aliases: Mapping[str, str] | None = None) -> None:
        self.aliases: dict[str, str] = {name: DEFAULT for name in OPENAI_VOICES}
        self.aliases.update(aliases or {})

    def resolve(self, name: str | None) -> str | None:
        """The voice to ask the stage for (None: its default)."""
        if name is None:
            return None
        return self.aliases.get(name, name) or None

    def listing(self, offered: list[str]) -> dict[str, Any]:
        """/v1/audio/voices: the stage's voices (the first its default), then the aliases."""
        default = offered[0] if offered else None
        data: list[dict[str, Any]] = [
            {"id": name, "object": "voice", "default": name == default} for name in offered
        ]
        for alias, target in sorted(self.aliases.items()):
            if alias not in offered:
                data.append(
                    {
                        "id": alias,
                        "object": "voice",
                        "alias_of": target or default,
                        "default": False,
                    }
                )
        return {"object": "list", "data": data}


def parse_alias(text: str) -> tuple[str, str]:
    """``NAME=VOICE`` (``NAME=``: the stage's default voice), for --voice-alias."""
    name, equals, voice = text.partition("=")
    if not equals or not name.strip():
        raise ValueError(f"--voice-alias {text!r}: expected NAME=VOICE (or NAME= for the default)")
    return name.strip(), voice.strip()
