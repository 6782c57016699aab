"""Loading one part of a Qwen3-Omni checkpoint: the thinker, the talker or code2wav.

Each stage builds only its part's modules (on the meta device, as
``from_pretrained`` does) and reads only that part's tensors from the folder's
safetensors, under their prefix in the whole model (``thinker.``, ``talker.``,
``code2wav.``): a talker stage never holds the thinker's 30B of weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from services.engines.base import EngineSettings, ModelInfo
from services.mesh.errors import InitFailed

Role = Literal["thinker", "talker", "code2wav"]


_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,  # a reference to measure the others against (tests)
}


def torch_dtype(settings: EngineSettings) -> torch.dtype:
    """The stage file's ``dtype``: a name in ``_DTYPES``; unset or "auto" is float32
    on a CPU (the reference the equivalence tests hold) and bfloat16 on a GPU (the
    released checkpoint's own dtype)."""
    name = settings.dtype
    if name in (None, "auto"):
        return torch.float32 if settings.device == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise InitFailed(
            f"dtype: {name!r} is not one of {['auto', *sorted(_DTYPES)]}", field="dtype"
        )
    return _DTYPES[name]


def checkpoint(model_path: Path | None, settings: EngineSettings, engine: str) -> Path:
    """The folder to load: the stage's model, or with ``load_format: dummy`` and no
    model the tiny random checkpoint (tiny.py), built once in the cache."""
    if model_path is None and settings.load_format == "dummy":
        from services.engines.qwen_omni import tiny

        return tiny.ensure(settings.cache_dir)
    if model_path is None or not model_path.is_dir():
        raise InitFailed(
            f"model: {engine} needs a Qwen3-Omni checkpoint folder as its model", field="model"
        )
    return model_path


def whole_config(folder: Path) -> Any:
    from transformers import Qwen3OmniMoeConfig

    return Qwen3OmniMoeConfig.from_pretrained(folder, local_files_only=True)


def _register_talker_mapping() -> None:
    """The talker's config has an empty model_type, so transformers would not apply
    the per-expert → fused MoE renaming the whole model's checkpoint was saved
    with; four expert tensors per layer would stay random. Name it by class."""
    from transformers import conversion_mapping as cm

    name = "Qwen3OmniMoeTalkerForConditionalGeneration"
    if name not in cm.USER_REGISTERED_MAPPINGS:
        cm.register_checkpoint_conversion_mapping(
            name, cm.get_checkpoint_conversion_mapping("qwen2_moe"), overwrite=True
        )


def load_part(folder: Path, role: Role, dtype: torch.dtype, device: str) -> tuple[Any, Any]:
    """``(module, whole config)``: the ``role`` part of checkpoint ``folder``, in eval mode."""
    import transformers as tf

    config = whole_config(folder)
    common: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if dtype == torch.float64:  # torch's grouped products take no float64: the plain loop
        common["experts_implementation"] = "eager"
    if role == "thinker":
        cls: Any = tf.Qwen3OmniMoeThinkerForConditionalGeneration
        part = cls.from_pretrained(folder, config=config.thinker_config, **common)
    elif role == "talker":
        _register_talker_mapping()
        talker_config = config.talker_config
        # The talker's rope index reads the audio settings it shares with the thinker.
        talker_config.audio_config = config.thinker_config.audio_config
        cls = tf.Qwen3OmniMoeTalkerForConditionalGeneration
        part = cls.from_pretrained(
            folder, config=talker_config, key_mapping={r"^talker\.": ""}, **common
        )
    else:
        cls = tf.Qwen3OmniMoeCode2Wav
        part = cls.from_pretrained(
            folder, config=config.code2wav_config, key_mapping={r"^code2wav\.": ""}, **common
        )
    return part.to(device).eval(), config


@dataclass(frozen=True)
class Part:
    """One engine's part as it loaded: the module, the whole checkpoint's config,
    and what ``load`` reports."""

    folder: Path
    model: Any
    config: Any
    info: ModelInfo


def load_engine_part(
    model_path: Path | None, settings: EngineSettings, engine: str, role: Role
) -> Part:
    """What each of the three engines' ``load`` does: find the checkpoint, load
    just ``role``'s weights in the stage's dtype on its device, and size them."""
    folder = checkpoint(model_path, settings, engine)
    model, config = load_part(folder, role, torch_dtype(settings), settings.device)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    info = ModelInfo(size, description=f"Qwen3-Omni {role} of {folder.name}")
    return Part(folder, model, config, info)
