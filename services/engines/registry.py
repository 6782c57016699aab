"""Engines by name. Each entry imports its module only when asked for, so a CPU
stage never imports vllm and a GPU image need not carry diffusers.

Plug-in engines: a stage file may name an engine class outside this package as
``engine: "package.module:ClassName"`` (an importable module, a colon, a class
that implements ``services.engines.base.Engine``). The module is imported when
the stage file is loaded; a name that does not resolve fails the stage file's
check. An engine's ``engine_args`` model (``settings_model``) is found here too.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from services.engines.base import Engine
from services.engines.engine_args import EngineArgs


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


def _speech() -> type[Engine]:
    from services.engines.speech import SpeechEngine

    return SpeechEngine


def _whisper() -> type[Engine]:
    from services.engines.whisper import WhisperEngine

    return WhisperEngine


def _qwen_omni(role: str) -> Callable[[], type[Engine]]:
    def engine() -> type[Engine]:
        from services.engines import qwen_omni

        found: type[Engine] = getattr(qwen_omni, role)
        return found

    return engine


ENGINES: dict[str, Callable[[], type[Engine]]] = {
    "transformers": _transformers,
    "diffusers": _diffusers,
    "vllm": _vllm,
    "video": _video,
    "video_frames": _video_frames,
    "speech": _speech,
    "whisper": _whisper,
    # One engine per part: each part accepts, emits and is tuned differently, and
    # a stage reads those from the engine class before any engine_args.
    "qwen_omni_thinker": _qwen_omni("QwenOmniThinker"),
    "qwen_omni_talker": _qwen_omni("QwenOmniTalker"),
    "qwen_omni_code2wav": _qwen_omni("QwenOmniCode2Wav"),
}


_PLUGIN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def is_plugin(name: str) -> bool:
    """Whether ``name`` has the ``package.module:ClassName`` form of a plug-in engine."""
    return _PLUGIN.fullmatch(name) is not None


def engine_class(name: str) -> type[Engine]:
    if is_plugin(name):
        module_name, _, class_name = name.partition(":")
        try:
            found: type[Engine] = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"plug-in engine {name!r} cannot be loaded: {exc}") from None
        return found
    try:
        return ENGINES[name]()
    except KeyError:
        known = ", ".join(sorted(ENGINES))
        raise ValueError(
            f"unknown engine {name!r} (known: {known}, or package.module:ClassName)"
        ) from None


def settings_model(name: str) -> type[EngineArgs] | None:
    """The ``engine_args`` model of the engine ``name`` (its class attribute
    ``settings_model``); None for a plug-in that takes a plain mapping."""
    model = getattr(engine_class(name), "settings_model", None)
    return model if isinstance(model, type) and issubclass(model, EngineArgs) else None
