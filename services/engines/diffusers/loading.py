"""Turning a stage's settings into a pipeline on its device, and measuring it."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from services.engines.base import EngineSettings
from services.engines.diffusers.config import DiffusersArgs
from services.engines.diffusers.dummy import build_dummy_pipeline
from services.mesh.errors import InitFailed

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def load_pipeline(
    settings: EngineSettings, args: DiffusersArgs, model_path: Path | None
) -> tuple[DiffusionPipeline, str]:
    """The pipeline on ``settings.device``, and a one-line description of it."""
    dtype = torch_dtype(settings)
    pipe: DiffusionPipeline
    if settings.load_format == "dummy":
        pipe = build_dummy_pipeline(
            cross_attention_dim=args.cross_attention_dim,
            sample_size=args.sample_size,
            seed=args.dummy_seed,
            torch_dtype=dtype,
        )
        description = "dummy StableDiffusionPipeline (random weights)"
    elif model_path is None:
        raise InitFailed("model: a diffusers pipeline folder is needed (or load_format: dummy)")
    else:
        folder = pipeline_folder(Path(model_path))
        try:
            # torch_dtype, not dtype: the one spelling every diffusers in our range takes.
            pipe = DiffusionPipeline.from_pretrained(
                folder, torch_dtype=dtype, local_files_only=True
            )
        except Exception as exc:
            logger.exception("loading the diffusers pipeline in %s failed", folder)
            raise InitFailed(
                f"could not load the diffusers pipeline {folder.name!r} "
                f"({type(exc).__name__}; see the stage log)"
            ) from exc
        description = type(pipe).__name__
    pipe = pipe.to(settings.device)
    pipe.set_progress_bar_config(disable=True)
    return pipe, description


def torch_dtype(settings: EngineSettings) -> torch.dtype:
    if settings.dtype in (None, "auto"):
        # bf16 on accelerators: fp16 overflows in some VAEs; CPU kernels want fp32.
        return torch.float32 if settings.device == "cpu" else torch.bfloat16
    try:
        return _DTYPES[settings.dtype]
    except KeyError:
        known = ", ".join(sorted(_DTYPES))
        raise InitFailed(f"unknown dtype {settings.dtype!r} (known: {known})") from None


def pipeline_folder(path: Path) -> Path:
    """The folder holding ``model_index.json``: ``path`` itself, or its only child
    folder (an unpacked archive usually wraps the pipeline in one)."""
    if (path / "model_index.json").is_file():
        return path
    if path.is_dir():
        children = [p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")]
        if len(children) == 1 and (children[0] / "model_index.json").is_file():
            return children[0]
    raise InitFailed(f"no diffusers pipeline (model_index.json) in {path.name!r}")


def model_bytes(pipe: DiffusionPipeline) -> int:
    """Bytes the weights and buffers of every component take on the device."""
    total = 0
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            for tensor in (*module.parameters(), *module.buffers()):
                total += tensor.numel() * tensor.element_size()
    return total


def native_size(pipe: DiffusionPipeline) -> int | None:
    """The image side the denoiser was built for, when the pipeline says."""
    unet_config = getattr(getattr(pipe, "unet", None), "config", None)
    sample_size = getattr(unet_config, "sample_size", None)
    scale = getattr(pipe, "vae_scale_factor", None)
    if isinstance(sample_size, int) and isinstance(scale, int):
        return sample_size * scale
    return None


def cross_attention_dim(pipe: DiffusionPipeline) -> int | None:
    """The width ``prompt_embeds`` must have for this pipeline's denoiser."""
    unet_config = getattr(getattr(pipe, "unet", None), "config", None)
    dim = getattr(unet_config, "cross_attention_dim", None)
    if isinstance(dim, int):
        return dim
    encoder_config = getattr(getattr(pipe, "text_encoder", None), "config", None)
    hidden = getattr(encoder_config, "hidden_size", None)
    return hidden if isinstance(hidden, int) else None
