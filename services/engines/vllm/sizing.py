"""What a vLLM model costs per device: weight bytes and the KV page geometry.

vLLM loads the weights in its engine-core process, out of this one's sight, so the
weight bytes are counted from the architecture instead of measured.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from services.engines.base import KvGeometry

logger = logging.getLogger(__name__)


def model_bytes(
    hf_config: PretrainedConfig, dtype: torch.dtype, tensor_parallel: int, model_dir: Path
) -> int:
    """Bytes of weights on each device: the architecture's parameters at ``dtype``,
    built on the meta device (no memory), split over ``tensor_parallel`` ranks.

    Falls back to the size of the checkpoint files for architectures transformers
    cannot build (then 0 for ``load_format: dummy``, which has none).
    """
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        total = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    except Exception as exc:  # an architecture only vLLM knows
        logger.warning(
            "cannot count the parameters of %s (%s); using checkpoint file sizes",
            type(hf_config).__name__,
            exc,
        )
        total = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return total // max(1, tensor_parallel)


def kv_geometry(vllm_config: Any) -> KvGeometry:
    """The KV layout of a built ``vllm.config.VllmConfig`` (docs/design.md, 'Memory planning')."""
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    # "auto" keeps the model's dtype; the fp8 variants store one byte per element.
    dtype_bytes = 1 if cache_dtype.startswith("fp8") else model_config.dtype.itemsize
    return KvGeometry(
        layers=model_config.get_num_layers(parallel_config),
        kv_heads=model_config.get_total_num_kv_heads(),
        head_dim=model_config.get_head_size(),
        dtype_bytes=dtype_bytes,
        tensor_parallel=parallel_config.tensor_parallel_size,
    )
