"""Linear layers that keep a GGUF file's own weight blocks (Q4_1, Q8_0) on the CPU.

A decode step reads every weight once per token, so on a CPU its speed is the
bytes per weight: float32 reads 32 bits, the file's Q4_1 blocks 5 (4-bit weights,
a float16 scale and min per 32, kept as they are). ``_block_products.c`` multiplies float32
activations straight from those blocks: the activations are not quantised (unlike
llama.cpp's kernels), and each weight is dequantised exactly as the plain path
dequantised it at conversion, ``(d * q) + m`` in float32. The answers are float32's
up to the order of the additions; ``benchmarks/precision_agreement.py`` measures
the greedy agreement.

Which blocks belong to which layer is found by value, not by name: a layer takes
the file's tensor whose dequantised rows are exactly its float32 weight's rows, in
any order (llama.cpp stores the q and k projections with their rows permuted for
its rotary layout). So a layer either runs on blocks that reproduce its weight bit
for bit or keeps its float32 path; no architecture's naming is assumed.

Products of many rows (a prefill) dequantise the weight into a scratch float32
matrix and hand it to torch's GEMM, which is faster there than the row-tiled kernel.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import safetensors
import safetensors.torch
import torch
from torch import nn

logger = logging.getLogger(__name__)

kernels: ModuleType | None
_IMPORT_ERROR: str | None = None
try:  # built by pip install (setup.py); absent where no C compiler was found
    # By module path: a from-import inside this package's __init__ would report a
    # missing build as a circular import.
    kernels = importlib.import_module("services.engines.transformers._block_kernels")
except ImportError as error:  # pragma: no cover - depends on the install
    kernels, _IMPORT_ERROR = None, str(error)

QK = 32  # weights per block, both formats
# Rows from which a product dequantises the weight (into a reused scratch) for
# torch's GEMM instead. A prefill's weights come from memory, not cache: over all of
# SmolLM2-135M's layers the kernel took 0.41-0.8x the time of dequantise + GEMM from
# 16 to 128 rows and about the same from 192 (2 threads, a quiet 2-core EPYC).
MANY_ROWS = 128
# GGML type ids (gguf.GGMLQuantizationType) and bytes per block.
_Q4_1, _Q8_0 = 3, 8
_BLOCK_BYTES = {_Q4_1: 20, _Q8_0: 34}
_TYPE_NAMES = {_Q4_1: "q4_1", _Q8_0: "q8_0"}


def unavailable() -> str | None:
    """Why block weights cannot run here, or None when they can."""
    if kernels is None:
        return f"the block kernels were not built ({_IMPORT_ERROR})"
    return None


def simd() -> str:
    """The kernels' code path on this CPU: "avx512", "generic" (plain C), or "none"."""
    return "none" if kernels is None else kernels.simd()


@dataclass
class Blocks:
    """One weight in blocks: ``qs`` [n][k/32][16 or 32], ``d`` (and ``m`` for
    Q4_1) float16 [n][k/32], as in the file (other dtypes are rounded to it)."""

    kind: str  # "q4_1" | "q8_0"
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    def __post_init__(self) -> None:
        self.d = self.d.to(torch.float16).contiguous()
        if self.m is not None:
            self.m = self.m.to(torch.float16).contiguous()

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * QK

    def rows(self, order: torch.Tensor) -> Blocks:
        """These blocks with their rows in ``order``."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, order).contiguous()

        return Blocks(
            self.kind, pick(self.qs), pick(self.d), None if self.m is None else pick(self.m)
        )

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        out = torch.empty(n, k) if out is None else out
        assert kernels is not None
        threads = torch.get_num_threads()
        if self.kind == "q4_1":
            assert self.m is not None
            kernels.q4_1_dequant(
                self.qs.data_ptr(),
                self.d.data_ptr(),
                self.m.data_ptr(),
                n,
                k,
                out.data_ptr(),
                threads,
            )
        else:
            kernels.q8_0_dequant(
                self.qs.data_ptr(), self.d.data_ptr(), n, k, out.data_ptr(), threads
            )
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)


def _half(column: np.ndarray) -> torch.Tensor:
    """A [..., 2] uint8 slice holding float16s, as float16 [...]."""
    return torch.from_numpy(np.ascontiguousarray(column).view(np.float16)[..., 0].copy())


def _blocks(raw: np.ndarray, ggml_type: int) -> Blocks:
    """Split a GGUF tensor's raw bytes ([n][bytes per row], uint8) into arrays."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, _BLOCK_BYTES[ggml_type])
    if ggml_type == _Q4_1:
        return Blocks(
            "q4_1",
            torch.from_numpy(np.ascontiguousarray(blocks[..., 4:])),
            _half(blocks[..., 0:2]),
            _half(blocks[..., 2:4]),
        )
    qs = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return Blocks("q8_0", torch.from_numpy(qs), _half(blocks[..., 0:2]), None)


class BlockLinear(nn.Module):
    """``nn.Linear``'s forward over a weight held in GGUF blocks (float32 in and out)."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = blocks.shape
        self.kind = blocks.kind
        self.register_buffer("qs", blocks.qs, persistent=False)
        self.register_buffer("d", blocks.d, persistent=False)
        self.register_buffer("m", blocks.m, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.to(torch.float32).contiguous()
        rows = x2.shape[0]
        if rows >= MANY_ROWS:
            blocks = Blocks(self.kind, self.qs, self.d, self.m)
            weight = blocks.dequantize(_scratch(self.out_features, self.in_features))
            y = torch.nn.functional.linear(x2, weight, self.bias)
        else:
            y = self._kernel(x2, rows)
        return y.reshape(*shape[:-1], self.out_features)

    def _kernel(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        assert kernels is not None
        n, k = self.out_features, self.in_features
        y = torch.empty(rows, n)
        threads = torch.get_num_threads()
        if self.m is not None:  # q4_1
            kernels.q4_1_linear(
                x.data_ptr(), rows, k, self.qs.data_ptr(), self.d.data_ptr(), self.m.data_ptr(),
                n, y.data_ptr(), threads,
            )  # fmt: skip
        else:
            kernels.q8_0_linear(
                x.data_ptr(),
                rows,
                k,
                self.qs.data_ptr(),
                self.d.data_ptr(),
                n,
                y.data_ptr(),
                threads,
            )
        if self.bias is not None:
            y += self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} blocks"
        )


_SCRATCH = threading.local()
SCRATCH_KEPT = 4 << 20  # floats: 16 MiB, four times a 1536 x 576 projection


def _scratch(n: int, k: int) -> torch.Tensor:
    """A float32 [n][k] to dequantise a weight into for one product, reused by this
    thread's next one: a fresh allocation of megabytes costs its page faults every
    time (more than the dequantisation). Weights past SCRATCH_KEPT (a tied output head
    over a big vocabulary) get a fresh one, so that none is held for good."""
    if n * k > SCRATCH_KEPT:
        return torch.empty(n, k)
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.numel() < n * k:
        buffer = _SCRATCH.buffer = torch.empty(n * k)
    return buffer[: n * k].view(n, k)


def _row_keys(matrix: torch.Tensor) -> list[bytes]:
    """Each row's bytes: equal rows, equal keys."""
    array = matrix.numpy()
    return [row.tobytes() for row in array]


def _fingerprint(keys: list[bytes]) -> int:
    """The same for two matrices with the same rows in any order."""
    return hash(tuple(sorted(hash(key) for key in keys)))


def gguf_block_linears(model: nn.Module, gguf: Path, layout_file: Path | None = None) -> int:
    """Replace each float32 ``nn.Linear`` of ``model`` whose weight is exactly a Q4_1
    or Q8_0 tensor of ``gguf`` (rows in any order) by a ``BlockLinear`` over that
    tensor's blocks, in place; call before packing the rest. Returns how many.

    Matching reads and dequantises the whole file (seconds); ``layout_file`` keeps
    its result, each layer's blocks in its own row order, for the next load of the
    same file (the caller keys it to the file, as the converted folder is)."""
    linears: dict[str, nn.Linear] = {
        name: module
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module.weight.dtype == torch.float32
    }
    layout = _read_layout(layout_file, linears) if layout_file else None
    if layout is None:
        layout = _match(linears, gguf)
        if layout_file is not None:
            _write_layout(layout_file, layout)
    for name, blocks in layout.items():
        child = linears[name]
        parent_name, _, attribute = name.rpartition(".")
        bias = None if child.bias is None else child.bias.detach()
        setattr(model.get_submodule(parent_name), attribute, BlockLinear(blocks, bias))
    return len(layout)


def _match(linears: dict[str, nn.Linear], gguf: Path) -> dict[str, Blocks]:
    """Each linear's blocks, its rows found by value among the file's tensors."""
    from gguf import GGUFReader  # gguf-py: a dependency of the GGUF conversion already

    reader = GGUFReader(str(gguf))
    by_print: dict[tuple[tuple[int, int], int], list[tuple[Blocks, list[bytes]]]] = defaultdict(
        list
    )
    shapes = {tuple(module.weight.shape) for module in linears.values()}
    for tensor in reader.tensors:
        ggml_type = int(tensor.tensor_type)
        raw = np.asarray(tensor.data)
        if ggml_type not in _BLOCK_BYTES or raw.ndim != 2:
            continue
        blocks = _blocks(raw, ggml_type)
        if blocks.shape not in shapes:
            continue
        keys = _row_keys(blocks.dequantize())
        by_print[(blocks.shape, _fingerprint(keys))].append((blocks, keys))

    layout: dict[str, Blocks] = {}
    for name, module in linears.items():
        weight = module.weight.detach()
        keys = _row_keys(weight)
        found = by_print.get((tuple(weight.shape), _fingerprint(keys)))  # type: ignore[arg-type]
        if not found:
            continue
        blocks, file_keys = found[0]  # tied weights share one tensor: it stays listed
        where: dict[bytes, list[int]] = defaultdict(list)
        for index, key in enumerate(file_keys):
            where[key].append(index)
        try:  # keys are the rows' exact bytes: every row found means an exact match
            order = torch.tensor([where[key].pop() for key in keys], dtype=torch.long)
        except (KeyError, IndexError):  # the fingerprints collided; never in practice
            continue
        layout[name] = blocks.rows(order)
    return layout


def _write_layout(path: Path, layout: dict[str, Blocks]) -> None:
    tensors = {}
    for name, blocks in layout.items():
        tensors[f"{name}.qs"], tensors[f"{name}.d"] = blocks.qs, blocks.d
        if blocks.m is not None:
            tensors[f"{name}.m"] = blocks.m
    kinds = json.dumps({name: blocks.kind for name, blocks in layout.items()})
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    safetensors.torch.save_file(tensors, str(tmp), metadata={"kinds": kinds})
    tmp.chmod(0o644)  # safetensors writes owner-only files; the cache may be shared
    os.replace(tmp, path)  # atomic: a racing stage reads a whole file or none


def _read_layout(path: Path, linears: dict[str, nn.Linear]) -> dict[str, Blocks] | None:
    """The layout saved by an earlier load, or None if absent or not this model's."""
    if not path.is_file():
        return None
    with safetensors.safe_open(str(path), framework="pt") as stored:
        kinds = json.loads((stored.metadata() or {}).get("kinds", "{}"))
        layout = {}
        for name, kind in kinds.items():
            module = linears.get(name)
            if module is None:
                return None
            m = stored.get_tensor(f"{name}.m") if kind == "q4_1" else None
            blocks = Blocks(
                kind, stored.get_tensor(f"{name}.qs"), stored.get_tensor(f"{name}.d"), m
            )
            if blocks.shape != tuple(module.weight.shape):
                return None
            layout[name] = blocks
    return layout
