"""Tiny random decoders of each architecture the fast CPU runner claims (Llama, Qwen2
with q/k/v biases, Qwen3 with per-head q/k norms, Mistral without a window), and the
same model with its decoder linears on GGUF blocks.

``on_blocks`` quantises each linear with gguf-py (Q4_1 or Q8_0), as a GGUF file holds
it, and first sets the float weight to the blocks' dequantised values: a copy taken
then computes with exactly the weights the blocks hold, so the reference runner on
the copy and the fast runner on the blocks differ only in their arithmetic.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import gguf
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from services.engines.transformers.weights.blocks import BlockLinear, Blocks

SHAPE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "attn_implementation": "sdpa",
}

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(**SHAPE),
    "qwen2": lambda: Qwen2Config(**SHAPE),  # q, k and v have biases
    "qwen3": lambda: Qwen3Config(**SHAPE),  # per-head q and k norms
    "mistral": lambda: MistralConfig(**SHAPE, sliding_window=None),
}
_TYPES = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}


def tiny(name: str, **overrides: Any) -> PreTrainedModel:
    """A tiny random model whose every part matters: the init leaves biases at zero and
    norm weights at one, which would let a dropped bias or norm weight pass."""
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
            elif "RMSNorm" in type(module).__name__:
                module.weight.normal_(1, 0.3)
    return model


def on_blocks(model: PreTrainedModel, kind: str = "q4_1") -> PreTrainedModel:
    """``model`` with every decoder linear on ``kind`` blocks (in place), and returns
    a float32 copy holding the same weights dequantised."""
    linears = {
        name: module
        for name, module in model.model.layers.named_modules()
        if type(module) is nn.Linear
    }
    with torch.no_grad():
        blocks = {}
        for name, linear in linears.items():
            raw = gguf.quants.quantize(linear.weight.numpy(), _TYPES[kind])
            blocks[name] = Blocks.of_gguf(raw, int(_TYPES[kind]))
            linear.weight.copy_(blocks[name].dequantize())
    plain = copy.deepcopy(model)
    for name, linear in linears.items():
        parent, _, attribute = name.rpartition(".")
        bias = None if linear.bias is None else linear.bias.detach()
        setattr(
            model.model.layers.get_submodule(parent), attribute, BlockLinear(blocks[name], bias)
        )
    return plain
