"""The decoding rows of a Qwen3-Omni part (the thinker, the talker): one padded KV
cache (services/engines/kv_cache.py) and each row's multimodal rotary offset; and what
both parts' model runners share of the scheduler's contract (``OmniRunner``).

Qwen3-Omni rotates by 3D positions (time, height, width) where a prompt holds an
image or audio, and by the text position plus a per-request offset (its
``rope_delta``) after it. A prompt with media runs alone (its own encoders, its own
positions), prompts of text alone together (right-padded); their rows then join
the batch, each carrying its offset, so a decode step's positions are every row's
own: [4, rows, 1], the text positions (which the causal mask reads) then the three
rotary ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import torch

from services.engines.kv_cache import KvCache, KvShape

R = TypeVar("R")


class OmniRows(Generic[R]):
    def __init__(self, shape: KvShape) -> None:
        self.shape = shape
        self.requests: list[R] = []
        self.kv = KvCache(shape)
        self.deltas = torch.zeros(0, dtype=torch.long, device=shape.device)

    def __len__(self) -> int:
        return len(self.requests)

    def join(self, requests: Sequence[R], kv: KvCache, deltas: Sequence[int]) -> None:
        """Prefilled requests' rows (``kv``, one row each, in order) join the batch."""
        self.kv.concat(kv)
        self.requests.extend(requests)
        self.deltas = torch.cat([self.deltas, self.deltas.new_tensor(list(deltas))])

    def keep(self, leaving: set[R]) -> None:
        keep = [i for i, r in enumerate(self.requests) if r not in leaving]
        if len(keep) != len(self.requests):
            self.kv.select(keep)
            self.requests = [self.requests[i] for i in keep]
            self.deltas = self.deltas[keep]

    def positions(self, valid: torch.Tensor) -> torch.Tensor:
        """[4, rows, W]: each row's text positions, then its rotary ones (+ its delta)."""
        text = self.kv.positions(valid)
        rotary = (text + self.deltas[:, None])[None].expand(3, -1, -1)
        return torch.cat([text[None], rotary], dim=0)

    def step_mask(self, stepping: Sequence[R]) -> torch.Tensor:
        """valid [rows, 1]: 1 for the rows that take this step, 0 for the others (a
        talker waiting for its thinker: a padding column it does not see)."""
        taking = set(map(id, stepping))
        return torch.tensor(
            [[1 if id(r) in taking else 0] for r in self.requests],
            dtype=torch.long,
            device=self.shape.device,
        )


class OmniRunner(Generic[R]):
    """What the thinker's and the talker's model runners share: their decoding rows
    (``rows``), which a prefill makes (admitting a request adds none); every request
    fits (the stage's ``max_batch_size`` bounds the batch); prefill and decode run as
    separate forwards."""

    mixes = False

    def __init__(self, shape: KvShape) -> None:
        self._shape = shape
        self.rows: OmniRows[R] = OmniRows(shape)

    def fits(self, members: Sequence[R]) -> bool:
        return True

    def admit(self, admitted: Sequence[R]) -> None:
        return None

    def free(self, gone: Sequence[R]) -> None:
        self.rows.keep(set(gone))

    def reset(self) -> None:
        self.rows = OmniRows(self._shape)


def prompt_positions(positions: torch.Tensor) -> torch.Tensor:
    """[4, R, S] from prompts' rotary positions [3, R, S] (right-padded): the text
    positions first."""
    rows, length = positions.shape[1:]
    text = torch.arange(length, device=positions.device).view(1, 1, -1).expand(1, rows, -1)
    return torch.cat([text, positions], dim=0)


def right_padded(rows: Sequence[torch.Tensor], pad: float | int = 0) -> torch.Tensor:
    """Rows of different lengths ([L_i, ...] each) as one [R, max L_i, ...] tensor."""
    width = max(row.shape[0] for row in rows)
    out = rows[0].new_full((len(rows), width, *rows[0].shape[1:]), pad)
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
    return out
