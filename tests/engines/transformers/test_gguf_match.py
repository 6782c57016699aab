"""Each linear of the real SmolLM2 takes the GGUF file's blocks of its own weight (found
by value: rows in any order, as llama.cpp permutes q and k), bit for bit, and a
BlockLinear runs them as nn.Linear would: the kernels' products below MANY_ROWS rows,
a dequantised GEMM from there (tests/kernels hold the products' own checks).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader
from torch import nn

from services import kernels
from services.engines.base import EngineSettings
from services.engines.transformers.config import TransformersArgs
from services.engines.transformers.loading import load_model
from services.engines.transformers.weights.blocks import MANY_ROWS, BlockLinear, Blocks
from services.engines.transformers.weights.gguf_match import gguf_block_linears
from tests.helpers.float_error import assert_float32_close

pytestmark = pytest.mark.skipif(
    kernels.unavailable() is not None, reason=f"CPU kernels: {kernels.unavailable()}"
)


@pytest.fixture(scope="module")
def reader(smollm2_gguf: Path) -> GGUFReader:
    """The file, read once: parsing its metadata (the 49152-token vocabulary) takes
    seconds."""
    return GGUFReader(str(smollm2_gguf))


def _file_tensor(reader: GGUFReader, name: str) -> Blocks:
    """One tensor of the file in blocks, rows in the file's order."""
    tensor = next(t for t in reader.tensors if t.name == name)
    return Blocks.of_gguf(np.asarray(tensor.data), int(tensor.tensor_type))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 as its bit patterns: equal means bit for bit (-0.0 is not 0.0)."""
    return t.contiguous().view(torch.int32)


@pytest.fixture(scope="module")
def plain_model(smollm2_gguf: Path, omni_cache_dir: Path) -> nn.Module:
    """SmolLM2 in float32 with torch's own linears, as the engine loads it."""
    settings = EngineSettings(cache_dir=omni_cache_dir, engine_args={"weights": "plain"})
    args = TransformersArgs.of(settings)
    return load_model(smollm2_gguf, settings, args, torch.float32).model


@torch.inference_mode()
def test_every_q4_1_and_q8_0_linear_takes_the_blocks_of_its_own_weight(
    plain_model: nn.Module, smollm2_gguf: Path, reader: GGUFReader
) -> None:
    types = Counter(int(t.tensor_type) for t in reader.tensors)
    q4_1, q8_0 = int(gguf.GGMLQuantizationType.Q4_1), int(gguf.GGMLQuantizationType.Q8_0)
    # 30 layers x (q, k, v, o, gate, up, down) in Q4_1; the output projection shares
    # the token embeddings, the file's one Q8_0 tensor.
    assert (types[q4_1], types[q8_0]) == (30 * 7, 1)
    before = {name: m for name, m in plain_model.named_modules() if type(m) is nn.Linear}
    assert len(before) == types[q4_1] + types[q8_0]

    assert gguf_block_linears(plain_model, smollm2_gguf) == len(before) == 211

    after = dict(plain_model.named_modules())
    for name, linear in before.items():
        layer = after[name]
        assert isinstance(layer, BlockLinear), name
        assert layer.kind == ("q8_0" if name == "lm_head" else "q4_1"), name
        weight = Blocks(layer.kind, layer.qs, layer.d, layer.m).dequantize()
        assert torch.equal(_bits(weight), _bits(linear.weight)), name
    # The matching is by rows, in any order: the file holds q and k permuted
    # (llama.cpp's rotary layout), v as the model does.
    for tensor, module in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
        in_file = _file_tensor(reader, f"blk.0.{tensor}.weight").dequantize()
        in_model = before[f"model.layers.0.self_attn.{module}"].weight
        assert torch.equal(in_file, in_model) == (module == "v_proj"), module


@pytest.mark.parametrize("rows", [1, 9, MANY_ROWS + 3])
@torch.inference_mode()
def test_a_block_linear_is_the_linear_of_its_dequantised_weight(
    reader: GGUFReader, rows: int
) -> None:
    """Below MANY_ROWS the kernels' product, from there the GEMM on the dequantised
    weight: float32's either way, with a bias and inputs of any layout."""
    blocks = _file_tensor(reader, "blk.0.ffn_down.weight")
    weight = blocks.dequantize()
    bias = torch.randn(weight.shape[0], generator=torch.Generator().manual_seed(1))
    layer = BlockLinear(blocks, bias)
    x = torch.randn(rows, 2, weight.shape[1], generator=torch.Generator().manual_seed(2))
    x = x.transpose(0, 1)  # [2, rows, k], not contiguous
    y = layer(x)
    assert y.shape == (2, rows, weight.shape[0])
    exact = nn.functional.linear(x.double(), weight.double(), bias.double())
    trusted = nn.functional.linear(x, weight, bias)
    assert_float32_close(y.flatten(0, 1), trusted.flatten(0, 1), exact.flatten(0, 1))
