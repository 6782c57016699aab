"""Linears that run on the GGUF file's own Q4_1 / Q8_0 blocks (block_linear.py), on
the real SmolLM2 file: the blocks dequantise exactly as gguf-py does, the kernel's
products are float32's up to the order of the additions, and every layer that
takes blocks takes the ones that reproduce its float32 weight.

What "float32's" means is derived, never fitted: against a float64 reference the
kernel may err as the suite allows any reordered float32 path (tests/helpers/
float_error.py: a multiple of torch's own float32 product's error), and no element
beyond the worst case of any summation order, k * eps * sum(|x| |w|) (Higham's
bound for a dot product of length k).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader
from torch import nn

from services.engines.base import EngineSettings
from services.engines.transformers import block_linear
from services.engines.transformers.block_linear import BlockLinear, Blocks, gguf_block_linears
from services.engines.transformers.config import TransformersArgs
from services.engines.transformers.loading import load_model
from tests.helpers.float_error import FLOAT32_EPS, RowErrors, row_errors

pytestmark = pytest.mark.skipif(
    block_linear.unavailable() is not None,
    reason=f"block kernels not built: {block_linear.unavailable()} (pip install -e .)",
)

# One Q4_1 tensor (k = 1536: 48 blocks a row) and the file's one Q8_0 tensor, the
# token embeddings the output projection shares (49152 x 576).
Q4_1_TENSOR = "blk.0.ffn_down.weight"
Q8_0_TENSOR = "token_embd.weight"
# 1 row: itself; 3 and 7: one tile padded to 4 and to 8 with zero rows; 8: a whole
# tile; 9: a tile and one row; 13: a tile and a padded one; MANY_ROWS and beyond: the
# weight dequantised for torch's GEMM.
ROWS = (1, 3, 7, 8, 9, 13, block_linear.MANY_ROWS, 2 * block_linear.MANY_ROWS + 1)


@pytest.fixture(scope="module")
def reader(smollm2_gguf: Path) -> GGUFReader:
    """The file, read once: parsing its metadata (the 49152-token vocabulary) takes
    seconds."""
    return GGUFReader(str(smollm2_gguf))


def _file_tensor(reader: GGUFReader, name: str) -> Blocks:
    """One tensor of the file in blocks, rows in the file's order."""
    tensor = next(t for t in reader.tensors if t.name == name)
    return block_linear._blocks(np.asarray(tensor.data), int(tensor.tensor_type))


@dataclass(frozen=True)
class FileWeight:
    """One tensor of the file: its raw bytes ([n][bytes per row]), its blocks, and
    their weight in float32, in float64 and its magnitude |w| in float64 (made once:
    the Q8_0 tensor has 28M weights)."""

    raw: np.ndarray
    blocks: Blocks
    weight: torch.Tensor
    exact: torch.Tensor
    magnitude: torch.Tensor


@pytest.fixture(scope="module", params=[Q4_1_TENSOR, Q8_0_TENSOR])
def file_weight(request: pytest.FixtureRequest, reader: GGUFReader) -> FileWeight:
    tensor = next(t for t in reader.tensors if t.name == request.param)
    raw = np.asarray(tensor.data)
    blocks = block_linear._blocks(raw, int(tensor.tensor_type))
    assert blocks.kind == {Q4_1_TENSOR: "q4_1", Q8_0_TENSOR: "q8_0"}[request.param]
    weight = blocks.dequantize()
    return FileWeight(raw, blocks, weight, weight.double(), weight.double().abs())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 as its bit patterns: equal means bit for bit (-0.0 is not 0.0)."""
    return t.contiguous().view(torch.int32)


def test_blocks_dequantise_bit_for_bit_as_gguf_py(file_weight: FileWeight) -> None:
    blocks, mine = file_weight.blocks, file_weight.weight
    kind = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}
    theirs = torch.from_numpy(gguf.quants.dequantize(file_weight.raw, kind[blocks.kind]))
    assert mine.shape == theirs.shape == blocks.shape
    assert torch.equal(_bits(mine), _bits(theirs))


def _errors(
    layer: nn.Module, file_weight: FileWeight, x: torch.Tensor, bias: torch.Tensor | None
) -> tuple[RowErrors, float]:
    """``layer(x)`` against float64, next to torch's float32 product with the file's
    weight; and the worst element's error as a fraction of the any-order bound."""
    y = layer(x)
    trusted = nn.functional.linear(x, file_weight.weight, bias)
    exact_bias = None if bias is None else bias.double()
    exact = nn.functional.linear(x.double(), file_weight.exact, exact_bias)
    k = file_weight.exact.shape[1]
    bound = k * FLOAT32_EPS * nn.functional.linear(x.double().abs(), file_weight.magnitude)
    if exact_bias is not None:  # one more addition, of |bias|
        bound += (k + 1) * FLOAT32_EPS * exact_bias.abs()
    worst = ((y.double() - exact).abs() / bound).max().item()
    return row_errors(y.flatten(0, -2), trusted.flatten(0, -2), exact.flatten(0, -2)), worst


def _inputs(k: int) -> Iterator[tuple[str, torch.Tensor]]:
    noise = torch.Generator().manual_seed(0)
    for rows in ROWS:
        yield f"{rows} rows", torch.randn(rows, k, generator=noise)
    # Non-contiguous (a transposed matrix, every other column of a wider one) and 3-D.
    yield "transposed", torch.randn(k, 9, generator=noise).T
    yield "strided", torch.randn(5, 2 * k, generator=noise)[:, ::2]
    yield "batch x sequence", torch.randn(2, 5, k, generator=noise)


@torch.inference_mode()
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_block_linear_is_float32_close_to_float64(file_weight: FileWeight, with_bias: bool) -> None:
    blocks = file_weight.blocks
    n, k = blocks.shape
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)) if with_bias else None
    layer = BlockLinear(blocks, bias)
    for label, x in _inputs(k):
        assert layer(x).shape == (*x.shape[:-1], n), label
        errors, worst = _errors(layer, file_weight, x, bias)
        assert errors.ok, (label, errors)
        assert worst <= 1.0, (label, worst)


@torch.inference_mode()
def test_a_row_gets_the_same_sum_in_any_tile(file_weight: FileWeight) -> None:
    """The kernel takes rows in tiles of 8, 4, 2 or 1, a last tile padded with zero
    rows: each row's output is the one it gets alone, bit for bit, whatever the batch
    (and the padding never reaches the output)."""
    layer = BlockLinear(file_weight.blocks, None)
    x = torch.randn(17, layer.in_features, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([layer(x[r : r + 1]) for r in range(17)])
    for rows in range(2, 18):
        assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"


def _one_block_off(blocks: Blocks, row: int, block: int) -> Blocks:
    """``blocks`` with every weight of one block moved by one quantisation step (the
    lowest bit of each 4- or 8-bit weight flipped): the smallest change a block can
    carry."""
    qs = blocks.qs.clone()
    flip = 0x11 if blocks.kind == "q4_1" else 0x01  # two nibbles a byte; one int8
    qs[row, block] = qs[row, block] ^ flip
    return Blocks(blocks.kind, qs, blocks.d, blocks.m)


@torch.inference_mode()
def test_a_block_one_step_off_fails_the_same_check(file_weight: FileWeight) -> None:
    """The checks above can fail: one block of one output row, each weight one step
    off, is caught by both, on the kernel's path and on the GEMM path alike (measured:
    3-30x over what is allowed for the Q8_0 tensor, 5-1000x for the Q4_1 one)."""
    blocks = file_weight.blocks
    n, k = blocks.shape
    wrong = BlockLinear(_one_block_off(blocks, row=n // 2, block=k // 64), None)
    assert not torch.equal(wrong.qs, blocks.qs)
    noise = torch.Generator().manual_seed(2)
    for rows in (1, 9, block_linear.MANY_ROWS):
        errors, worst = _errors(wrong, file_weight, torch.randn(rows, k, generator=noise), None)
        assert not errors.ok, (rows, errors)
        assert worst > 1.0, (rows, worst)


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
