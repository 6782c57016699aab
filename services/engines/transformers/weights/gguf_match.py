"""Which of a GGUF file's weight blocks belong to which linear layer of a loaded model.

Found by value, not by name: a layer takes the file's tensor whose dequantised rows
are exactly its float32 weight's rows, in any order (llama.cpp stores the q and k
projections with their rows permuted for its rotary layout). So a layer either runs
on blocks that reproduce its weight bit for bit or keeps its float32 path, and no
architecture's tensor naming is assumed. Matching reads and dequantises the whole
file (seconds); the result is kept in a layout file beside the converted weights,
so later loads read that instead.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import safetensors
import safetensors.torch
import torch
from torch import nn

from services.engines.transformers.weights.blocks import BLOCK_BYTES, BlockLinear, Blocks


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

    ``layout_file`` keeps the match, each layer's blocks in its own row order, for
    the next load of the same file (the caller keys it to the file, as the converted
    folder is)."""
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
        if ggml_type not in BLOCK_BYTES or raw.ndim != 2:
            continue
        blocks = Blocks.of_gguf(raw, ggml_type)
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
