"""The kernels under test, once per variant the build has: each test that takes the
``variant`` fixture runs on that variant (``kernels.using``), and one this CPU lacks
is skipped, naming what it lacks. Without the library every test here is skipped
saying why, and fails under CI=true: a CI run never passes without the fast path."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader

from services import kernels
from services.engines.transformers.weights.blocks import Blocks
from services.kernels import library

VARIANTS = library.build_variants()


@pytest.fixture(autouse=True)
def _built() -> None:
    why = kernels.unavailable()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI: {why}")
        pytest.skip(why)


@pytest.fixture(params=VARIANTS or ["none"])
def variant(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test on one variant of the kernels."""
    name = request.param
    if name not in kernels.runnable():
        pytest.skip(f"the {name} kernels cannot run here: this CPU lacks {library.lacks(name)}")
    with kernels.using(name):
        yield name


# One Q4_1 tensor (k = 1536: 48 blocks a row) and the file's one Q8_0 tensor, the
# token embeddings the output projection shares (49152 x 576).
Q4_1_TENSOR = "blk.0.ffn_down.weight"
Q8_0_TENSOR = "token_embd.weight"


@pytest.fixture(scope="module")
def reader(smollm2_gguf: Path) -> GGUFReader:
    """The file, read once (its 49152-token vocabulary takes seconds)."""
    return GGUFReader(str(smollm2_gguf))


@dataclass(frozen=True)
class FileWeight:
    """One tensor of the file: its raw bytes, its blocks, and its weight as gguf-py
    dequantises it, in float32, float64 and |w| in float64."""

    raw: np.ndarray
    blocks: Blocks
    weight: torch.Tensor
    exact: torch.Tensor
    magnitude: torch.Tensor


@pytest.fixture(scope="module", params=[Q4_1_TENSOR, Q8_0_TENSOR])
def file_weight(request: pytest.FixtureRequest, reader: GGUFReader) -> FileWeight:
    tensor = next(t for t in reader.tensors if t.name == request.param)
    raw = np.asarray(tensor.data)
    blocks = Blocks.of_gguf(raw, int(tensor.tensor_type))
    weight = torch.from_numpy(gguf.quants.dequantize(raw, tensor.tensor_type)).float()
    return FileWeight(raw, blocks, weight, weight.double(), weight.double().abs())
