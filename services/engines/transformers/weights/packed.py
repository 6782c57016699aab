"""Linear layers whose weights are packed once for oneDNN (CPU, float32 or bfloat16).

A batched decode step multiplies a few rows (one per running request) by every
weight of the model. torch's default CPU linear hands that to MKL's sgemm, which
re-lays the whole weight out into its blocked format on every call once there is
more than one row, so batching paid back little. Packing each weight into oneDNN's
blocked layout once, at load, removes that per-call copy, so a few rows cost little
more than one (figures in docs/benchmarks.md; ``benchmarks/stage_batching.py``
measures the effect through a stage).

The packed weight replaces the original (no second copy), except where the
output projection shares its weight with the input embeddings (tied weights):
the embedding lookup still needs the plain matrix, so that one weight is held
twice.

A bfloat16 model (``dtype: bfloat16``) is packed the same way where the CPU has
native bfloat16 kernels (AVX-512 BF16, AMX): half the bytes per token, and a
faster decode step than float32's (docs/benchmarks.md). Elsewhere oneDNN
would emulate bfloat16, so the model is left unpacked.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a weight packed for oneDNN."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight), persistent=False
        )
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def packing_applies(model: nn.Module) -> str | None:
    """Why the model's linears cannot be packed, or None when they can."""
    parameter = next(model.parameters(), None)
    if parameter is None:
        return "the model has no parameters"
    if parameter.device.type != "cpu":
        return f"the model is on {parameter.device.type}, not the CPU"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if parameter.dtype == torch.bfloat16 and not bfloat16_supported():
        return "this CPU has no oneDNN bfloat16 kernels"
    if parameter.dtype not in (torch.float32, torch.bfloat16):
        return f"the model is {parameter.dtype}, not float32 or bfloat16"
    return None


def bfloat16_supported() -> bool:
    """Whether oneDNN runs bfloat16 matmuls natively on this CPU (AVX-512 BF16, AMX):
    elsewhere it emulates them, slower than float32."""
    return bool(
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear``, in place.
    Returns how many were packed (0 when packing does not apply: see
    ``packing_applies``)."""
    reason = packing_applies(model)
    if reason is not None:
        logger.info("linear weights left unpacked: %s", reason)
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
