"""The keys and values of a batch of rows: one padded buffer per kind, and nothing else.

``keys`` and ``values`` are [layers, rows, kv_heads, room, head_dim]: row i of every
layer holds request i's positions, left-padded to the batch's ``width``; ``mask``
[rows, width] tells a row's own positions (1) from padding (0), and each row's
rotary positions are its own (``next_pos``), so padding never shifts a sequence. A
step writes the same number of new columns into every row (a decode step: one)
after ``reserve`` made room, so the buffers move only when the room runs out (then
with a quarter's headroom). Rows join (``add_rows``, ``concat``) and leave
(``select``) only between steps, and both drop the columns no remaining row uses, so
padding does not outlive the row that caused it.

It stores and hands out views: which forward reads it is the runner's choice (a
model runner: services/engines/transformers/runners/). It imports no model library:
``hf_cache.py`` adapts it to a transformers ``Cache`` for the models' own forwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class KvShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype, device: torch.device) -> KvShape:
        """From a model config (transformers' attribute names)."""
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            dtype=dtype,
            device=device,
        )

    def buffer(self, rows: int, room: int) -> torch.Tensor:
        return torch.zeros(
            self.layers,
            rows,
            self.kv_heads,
            room,
            self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )


class KvCache:
    def __init__(self, shape: KvShape, rows: int = 0) -> None:
        self.shape = shape
        self.keys = shape.buffer(rows, 0)
        self.values = shape.buffer(rows, 0)
        self.mask = torch.zeros((rows, 0), dtype=torch.long, device=shape.device)
        self.next_pos = torch.zeros(rows, dtype=torch.long, device=shape.device)

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        """Columns every row holds (its positions and its padding)."""
        return int(self.mask.shape[1])

    @property
    def room(self) -> int:
        return int(self.keys.shape[3])

    def reserve(self, new: int) -> None:
        """Room for ``new`` more columns (a copy into bigger buffers only when full)."""
        width = self.width
        if width + new <= self.room:
            return
        room = width + new + max(16, (width + new) // 4)
        keys, values = self.shape.buffer(self.rows, room), self.shape.buffer(self.rows, room)
        keys[..., :width, :] = self.keys[..., :width, :]
        values[..., :width, :] = self.values[..., :width, :]
        self.keys, self.values = keys, values

    def layer(self, index: int, new: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s keys and values [rows, kv_heads, width + new, head_dim]:
        views, ``new`` columns past the width included (written this step)."""
        end = self.width + new
        return self.keys[index, :, :, :end], self.values[index, :, :, :end]

    def write(
        self, index: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's new columns of layer ``index`` ([rows, kv_heads, new, head_dim],
        after ``reserve``), and the layer's keys and values through them."""
        width, new = self.width, keys.shape[2]
        self.keys[index, :, :, width : width + new] = keys
        self.values[index, :, :, width : width + new] = values
        return self.layer(index, new)

    def extend(self, valid: torch.Tensor) -> None:
        """After a step wrote W columns (``valid`` [rows, W]: which are real): they
        are the rows' own now."""
        self.mask = torch.cat([self.mask, valid], dim=1)
        self.next_pos = self.next_pos + valid.sum(1)

    def positions(self, valid: torch.Tensor) -> torch.Tensor:
        """Each row's rotary positions for the next W columns (``valid`` [rows, W])."""
        return (self.next_pos[:, None] + valid.cumsum(1) - 1).clamp(min=0)

    def add_rows(self, count: int) -> None:
        """Append ``count`` rows with no positions yet (padding in every column)."""
        self.concat(KvCache(self.shape, count))

    def repeat(self, count: int) -> None:
        """One row becomes ``count`` copies of it (a prompt prefix several share)."""
        assert self.rows == 1, "repeat a single row"
        self.keys = self.keys.expand(-1, count, -1, -1, -1).contiguous()
        self.values = self.values.expand(-1, count, -1, -1, -1).contiguous()
        self.mask = self.mask.expand(count, -1).contiguous()
        self.next_pos = self.next_pos.expand(count).contiguous()

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows``, in that order."""
        if list(rows) != list(range(self.rows)):
            self._adopt(self.take(rows))

    def take(self, rows: Sequence[int]) -> KvCache:
        """A new cache holding a copy of ``rows`` (this one is unchanged), without the
        columns none of them uses."""
        taken = KvCache(self.shape)
        if not rows:
            return taken
        index = torch.tensor(list(rows), dtype=torch.long, device=self.mask.device)
        mask = self.mask[index]
        used = mask.any(dim=0).nonzero().squeeze(1)
        taken.mask, taken.next_pos = mask[:, used], self.next_pos[index]
        taken.keys = self.keys[:, index][:, :, :, used]
        taken.values = self.values[:, index][:, :, :, used]
        return taken

    def concat(self, other: KvCache) -> None:
        """Append ``other``'s rows (which it then no longer owns) after these, both
        left-padded to the wider width."""
        if other.rows == 0:
            return
        if self.rows == 0:
            self._adopt(other)
            return
        width = max(self.width, other.width)
        keys = self.shape.buffer(self.rows + other.rows, width)
        values = self.shape.buffer(self.rows + other.rows, width)
        mask = self.mask.new_zeros(self.rows + other.rows, width)
        for start, part in ((0, self), (self.rows, other)):
            rows, columns = slice(start, start + part.rows), slice(width - part.width, width)
            keys[:, rows, :, columns] = part.keys[..., : part.width, :]
            values[:, rows, :, columns] = part.values[..., : part.width, :]
            mask[rows, columns] = part.mask
        self.keys, self.values, self.mask = keys, values, mask
        self.next_pos = torch.cat([self.next_pos, other.next_pos])

    def _adopt(self, other: KvCache) -> None:
        self.keys, self.values = other.keys, other.values
        self.mask, self.next_pos = other.mask, other.next_pos
