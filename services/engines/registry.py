"""Engines by name. Each entry imports its module only when asked for, so a CPU
stage never imports vllm and a GPU image need not carry diffusers."""

from __future__ import annotations

from collections.abc import Callable

from services.engines.base import Engine


def _transformers() -> type[Engine]:
    from services.engines.transformers import TransformersEngine

    return TransformersEngine


def _diffusers() -> type[Engine]:
    from services.engines.diffusers import DiffusersEngine

    return DiffusersEngine


def _vllm() -> type[Engine]:
    from services.engines.vllm import VllmEngine

    return VllmEngine


def _video() -> type[Engine]:
    from services.engines.video import VideoEngine

    return VideoEngine


def _video_frames() -> type[Engine]:
    from services.engines.video import FrameSourceEngine

    return FrameSourceEngine


ENGINES: dict[str, Callable[[], type[Engine]]] = {
    "transformers": _transformers,
    "diffusers": _diffusers,
    "vllm": _vllm,
    "video": _video,
    "video_frames": _video_frames,
}


def engine_class(name: str) -> type[Engine]:
    try:
        return ENGINES[name]()
    except KeyError:
        known = ", ".join(sorted(ENGINES))
        raise ValueError(f"unknown engine {name!r} (known: {known})") from None
