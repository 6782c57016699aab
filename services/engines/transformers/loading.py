"""Turning a model path into a model and a tokenizer.

An HF folder is loaded as is. A ``.gguf`` file is dequantised once into a
safetensors folder in the cache (about half a minute for SmolLM2-135M) and every
later load reads that folder (under a second).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from services import kernels
from services.engines.base import EngineSettings, KvGeometry, ModelInfo
from services.engines.gguf_cache import converted_target
from services.engines.transformers.config import TransformersArgs
from services.engines.transformers.weights.blocks import BlockLinear
from services.engines.transformers.weights.gguf_match import gguf_block_linears
from services.engines.transformers.weights.packed import pack_linears
from services.mesh.errors import InitFailed

logger = logging.getLogger(__name__)

# Which GGUF blocks each linear runs on (weights/gguf_match.py), kept beside the converted
# weights; the number changes whenever the layout's format does.
BLOCKS_LAYOUT = "gguf-blocks-2.safetensors"  # 2: float16 scales and mins


# What the float32 path costs a GGUF model where the kernels cannot run, as SmolLM2-135M
# measured at one request (docs/benchmarks.md).
SLOWER = "about 4x slower a token than on its GGUF blocks"


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    info: ModelInfo
    weights: str  # how the linears are held, and the kernels that run them


def load_model(
    model_path: Path, settings: EngineSettings, args: TransformersArgs, dtype: torch.dtype
) -> LoadedModel:
    folder = model_path
    if model_path.is_file() and model_path.suffix == ".gguf":
        folder = converted_folder(model_path, settings.cache_dir)
    elif not (model_path / "config.json").is_file():
        raise InitFailed(
            f"model: {model_path} is neither a Hugging Face model folder (with config.json) "
            "nor a .gguf file"
        )

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if settings.load_format == "dummy":
        model = _dummy_model(folder, settings, args, dtype)
    else:
        # v5 builds on the meta device and fills the weights in place on the target
        # device, so the weights are never held twice.
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, device_map=settings.device
        )
    model.eval()
    weights = _place_weights(model, model_path, settings, args, dtype)
    info = model_info(
        model, description=f"{type(model).__name__} from {model_path.name}, {weights}"
    )
    logger.info(
        "loaded %s (%s, %s, %.1f MiB)",
        model_path,
        settings.load_format,
        dtype,
        info.model_bytes / 2**20,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, info=info, weights=weights)


def _place_weights(
    model: PreTrainedModel,
    model_path: Path,
    settings: EngineSettings,
    args: TransformersArgs,
    dtype: torch.dtype,
) -> str:
    """Hold the linear weights as ``engine_args.weights`` says (see config.py); says
    how they are held and on which kernels (the LOAD_DONE message and Describe show
    it). Where a GGUF model cannot run on its blocks, the stage log says why and what
    it costs, once, at start."""
    blocks = 0
    if args.weights in ("auto", "gguf_blocks"):
        why = blocks_refused(model_path, settings, dtype)
        machine = kernels_refuse(args.weights == "auto") if why is None else None
        why = why or machine
        if why is None:
            layout = converted_folder(model_path, settings.cache_dir) / BLOCKS_LAYOUT
            blocks = gguf_block_linears(model, model_path, layout)
            logger.info("%d linear layers run on %s's own weight blocks", blocks, model_path.name)
        elif args.weights == "gguf_blocks":
            raise InitFailed(f"engine_args.weights: gguf_blocks {why}", field="engine_args.weights")
        elif machine:  # the stage file asked for what the blocks run; this install can't
            logger.warning(
                "%s runs on float32 weights, not its GGUF blocks (%s): %s",
                model_path.name,
                machine,
                SLOWER,
            )
    packed = pack_linears(model) if args.weights != "plain" else 0
    held = [f"{blocks} linears on GGUF blocks"] if blocks else []
    held += [f"{packed} packed for oneDNN"] if packed else []
    if blocks:
        int8 = args.activations == "int8"
        for module in model.modules():
            if isinstance(module, BlockLinear):
                module.int8 = int8
        held.append(f"kernels {kernels.describe()}, {args.activations} activations")
    elif args.activations == "int8":
        logger.warning("engine_args.activations: int8 applies to GGUF blocks only; none here")
    return ", ".join(held) or "linears as loaded"


def kernels_refuse(auto: bool = True) -> str | None:
    """Why this machine or install cannot run the blocks: no kernels, or (for ``auto``)
    only the reference ones, plain C++, slower than oneDNN's float32. The one place
    that decides it: the tests that expect blocks or float32 ask here too."""
    why = kernels.unavailable()
    if why is None and auto and kernels.variant() == "reference":
        why = "the CPU kernels have no vector variant for this CPU (neither AVX2 nor AVX-512)"
    return why


def blocks_refused(model_path: Path, settings: EngineSettings, dtype: torch.dtype) -> str | None:
    """Why the stage's own settings keep its weights off GGUF blocks, or None."""
    if model_path.suffix != ".gguf":
        return f"needs a .gguf model file, not {model_path.name}"
    if settings.load_format == "dummy":
        return "needs the file's weights (load_format is dummy)"
    if settings.device != "cpu":
        return f"runs on the CPU, not {settings.device}"
    if dtype != torch.float32:
        return f"runs float32 activations (dtype is {str(dtype).removeprefix('torch.')})"
    return None


def _dummy_model(
    folder: Path, settings: EngineSettings, args: TransformersArgs, dtype: torch.dtype
) -> PreTrainedModel:
    config = AutoConfig.from_pretrained(folder)
    for key, value in args.config_overrides.items():
        if not hasattr(config, key):
            raise ValueError(
                f"engine_args.config_overrides: {type(config).__name__} has no {key!r}"
            )
        setattr(config, key, value)
    # Building under the device context allocates the random weights there directly.
    with torch.device(settings.device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def model_info(model: PreTrainedModel, description: str = "") -> ModelInfo:
    tensors = [*model.parameters(), *model.buffers()]
    model_bytes = sum(t.numel() * t.element_size() for t in tensors)
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = KvGeometry(
        layers=config.num_hidden_layers,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        dtype_bytes=model.dtype.itemsize,
    )
    return ModelInfo(model_bytes=model_bytes, kv=kv, description=description)


def conversion_pending(model_path: Path, cache_dir: Path) -> str | None:
    """What loading ``model_path`` must do first, once: None if nothing (not a GGUF,
    or converted already)."""
    if model_path.suffix != ".gguf" or not model_path.is_file():
        return None
    _real, target = converted_target(model_path, cache_dir)
    if (target / "config.json").is_file():
        return None
    return f"converting {model_path.name} to safetensors (once per file)"


def converted_folder(gguf: Path, cache_dir: Path) -> Path:
    """The safetensors folder for ``gguf``, converting it on first use.

    The key changes whenever the file does (path, size, mtime), so a replaced file
    is converted again. Stages racing on the same file each convert into a private
    temp folder and rename it into place; the loser keeps the winner's folder.
    """
    real, target = converted_target(gguf, cache_dir)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        logger.info("converting %s into %s (once per file)", real, target)
        _convert(real, tmp)
        for path in tmp.iterdir():
            path.chmod(0o644)  # safetensors writes owner-only files
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.info("%s was converted concurrently; using that copy", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class ConvertsGguf:
    """``capabilities.PreparesModel`` for an engine that reads a GGUF file through its
    safetensors conversion (the transformers and vllm engines, into one cached
    folder): the stage's PREPARE step converts it, once per file, before ``load``."""

    _settings: EngineSettings

    def preparation(self, model_path: Path) -> str | None:
        return conversion_pending(model_path, self._settings.cache_dir)

    def prepare(self, model_path: Path) -> None:
        converted_folder(model_path, self._settings.cache_dir)


def _convert(gguf: Path, out: Path) -> None:
    """A standard HF folder, as transformers' own ``save_pretrained`` would write it:
    weights under their model's names with tied duplicates saved once under the
    source name (``model.embed_tokens.weight``, not ``lm_head.weight``: a loader
    that does not re-tie, vLLM for one, would otherwise find no embedding and
    generate token 0 forever), ``architectures`` in config.json, the tokenizer
    and the generation config."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = model.state_dict()
    # save_pretrained refuses gguf-quantised models, so the tied copies are dropped
    # here: each target (lm_head.weight) is the same tensor as its source.
    for target, source in model.all_tied_weights_keys.items():
        if target in state and source in state:
            del state[target]
    safetensors.torch.save_file(
        {name: t.contiguous() for name, t in state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain floats
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    generation = model.generation_config or GenerationConfig.from_model_config(config)
    generation.save_pretrained(out)
