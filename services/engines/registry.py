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

from services.engines.base import Engine
from services.engines.engine_args import EngineArgs

# Each engine as the ``module:Class`` that implements it, imported only when asked for.
ENGINES: dict[str, str] = {
    "transformers": "services.engines.transformers:TransformersEngine",
    "diffusers": "services.engines.diffusers:DiffusersEngine",
    "vllm": "services.engines.vllm:VllmEngine",
    "video": "services.engines.video:VideoEngine",
    "video_frames": "services.engines.video:FrameSourceEngine",
    "speech": "services.engines.speech:SpeechEngine",
    "whisper": "services.engines.whisper:WhisperEngine",
    # One engine per part: each part accepts, emits and is tuned differently, and
    # a stage reads those from the engine class before any engine_args.
    "qwen_omni_thinker": "services.engines.qwen_omni:QwenOmniThinker",
    "qwen_omni_talker": "services.engines.qwen_omni:QwenOmniTalker",
    "qwen_omni_code2wav": "services.engines.qwen_omni:QwenOmniCode2Wav",
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
    if name not in ENGINES:
        known = ", ".join(sorted(ENGINES))
        raise ValueError(f"unknown engine {name!r} (known: {known}, or package.module:ClassName)")
    module_name, _, class_name = ENGINES[name].partition(":")
    built_in: type[Engine] = getattr(importlib.import_module(module_name), class_name)
    return built_in


def settings_model(name: str) -> type[EngineArgs] | None:
    """The ``engine_args`` model of the engine ``name`` (its class attribute
    ``settings_model``); None for a plug-in that takes a plain mapping."""
    model = getattr(engine_class(name), "settings_model", None)
    return model if isinstance(model, type) and issubclass(model, EngineArgs) else None
