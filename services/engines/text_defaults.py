"""What autoregressive text engines share: the defaults a request gets for the
sampling parameters it leaves unset, and how much it may generate."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from services.mesh.errors import InvalidArgument


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for a parameter it leaves unset (engine_args ``defaults``)."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut

    @classmethod
    def parse(cls, raw: Any) -> SamplingDefaults:
        """From engine_args ``defaults``; ValueError naming the problem."""
        raw = raw or {}
        known = {f.name for f in fields(cls)}
        if not isinstance(raw, Mapping) or set(raw) - known:
            raise ValueError(
                f"engine_args.defaults: expected a mapping with keys among {sorted(known)}"
            )
        return cls(**raw)


def max_new_tokens(
    asked: int | None, default: int, room: int, where: str = "the model's context"
) -> int:
    """The tokens a request may generate in the ``room`` its prompt leaves in
    ``where``: an explicit value must fit (INVALID_ARGUMENT otherwise); an unset
    one is cut to fit."""
    if asked is None:
        return min(default, room)
    if not 1 <= asked <= room:
        raise InvalidArgument(
            f"params.max_tokens: must be between 1 and {room} (the room the prompt leaves "
            f"in {where}), got {asked}",
            field="params.max_tokens",
        )
    return asked
