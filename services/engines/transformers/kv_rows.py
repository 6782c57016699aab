"""The key/value cache of a batch of sequences: one padded ``DynamicCache``.

Row i of every layer holds sequence i. A column is one of that row's tokens or
padding, told apart by ``mask`` [rows, columns]; each row's positions are its
own (``next_pos``), so padding never shifts a sequence's rotary positions. A
step appends the same number of columns to every row (a decode step: one), so
the cache does not move while the batch is unchanged. Rows join (``concat``)
and leave (``select``) only between steps, and both drop the columns no
remaining row uses, so padding does not outlive the sequence that caused it.

Each layer keeps its keys and values in buffers with room to grow (``GrowingLayer``):
a decode step writes its column in place. transformers' own ``DynamicLayer``
concatenates, copying the whole cache every step: 7% of a batch-8 step's time on
SmolLM2 (py-spy), growing with the length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from services.engines.transformers.block_linear import MANY_ROWS
from services.engines.transformers.decode_stack import DecodeStack
from services.engines.transformers.lean_forward import LeanForward, lean_of, sdpa


class KvRows:
    def __init__(self, model: PreTrainedModel, rows: int = 0) -> None:
        self._model = model
        self.cache = DynamicCache(config=model.config)
        if any(type(layer) is not DynamicLayer for layer in self.cache.layers):
            # A sliding-window layer drops columns itself, which the mask cannot follow.
            raise ValueError("only models with full-attention caches can be batched")
        self.cache.layers = [GrowingLayer() for _ in self.cache.layers]
        device = model.device
        self.mask = torch.zeros((rows, 0), dtype=torch.long, device=device)
        self.next_pos = torch.zeros(rows, dtype=torch.long, device=device)

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def forward(
        self, embeds: torch.Tensor, valid: torch.Tensor, hidden: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``embeds`` [rows, W, hidden] as the next W columns of every row.

        ``valid`` [rows, W] marks real tokens; a row's real tokens are the last
        ones of its W (left padding), so the last column is every row's newest
        token. Returns float32 logits [rows, vocab] of that column and, when
        ``hidden``, the last layer's hidden state there [rows, hidden].
        """
        lean = lean_of(self._model)
        if (
            lean is not None
            and lean.fused
            and lean.stack is not None
            and embeds.dtype == torch.float32
        ):
            caches = self._stack_caches(embeds.shape[1])
            if caches is not None:
                return self._stack_step(lean, lean.stack, caches, embeds, valid, hidden)
        if lean is not None:
            mask = attention_mask(self.mask, valid)

            def attend(
                index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> torch.Tensor:
                layer = self.cache.layers[index]
                assert isinstance(layer, GrowingLayer)
                keys, values = layer.update(k, v)
                return sdpa(lean.layers[index].attn, q, keys, values, mask, lean.fused)

            logits, states = lean(embeds, self.positions(valid), attend, None, hidden)
            self.advance(valid)
            return logits, states
        out = self._model(
            inputs_embeds=embeds,
            attention_mask=torch.cat([self.mask, valid], dim=1),
            position_ids=self.positions(valid),
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=hidden,
            logits_to_keep=1,  # the other columns need no logits
        )
        self.advance(valid)
        states = out.hidden_states[-1][:, -1] if hidden else None
        return out.logits[:, -1].float(), states

    def _stack_caches(self, width: int) -> list[GrowingLayer] | None:
        """The cache's layers, where this step is one the decode stack runs: one column
        per row, fewer than MANY_ROWS rows, every layer already holding some; else None.
        (``_stack_step`` makes room for the column.)"""
        layers = self.cache.layers
        if width != 1 or not 0 < self.rows < MANY_ROWS or self.width == 0:
            return None
        if not all(isinstance(layer, GrowingLayer) and layer.is_initialized for layer in layers):
            return None
        return layers  # type: ignore[return-value]

    def _stack_step(
        self,
        lean: LeanForward,
        stack: DecodeStack,
        layers: list[GrowingLayer],
        embeds: torch.Tensor,
        valid: torch.Tensor,
        hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward`` for a decode step, the layer stack in one C call (decode_stack.py)."""
        rows, column = self.rows, self.width
        cos, sin = lean.rotary_rows(embeds, self.positions(valid))
        seen = torch.cat([self.mask, valid], dim=1)
        mask = None
        if not bool(seen.all()):
            mask = seen.to(torch.uint8)
            mask[:, -1] = 1  # a padding query still sees itself, as attention_mask has it
        caches = [layer.room(1) for layer in layers]
        h = embeds.reshape(rows, -1).clone()  # the residual stream, added into in place
        states = stack(h, cos, sin, caches, mask, column)
        for layer in layers:
            layer.extend(1)
        self.advance(valid)
        return lean.lm_head(states).float(), states if hidden else None

    def positions(self, valid: torch.Tensor) -> torch.Tensor:
        """Each row's rotary positions for the next W columns (``valid`` [rows, W])."""
        return (self.next_pos[:, None] + valid.cumsum(1) - 1).clamp(min=0)

    def advance(self, valid: torch.Tensor) -> None:
        """After a forward over the next W columns: they are part of every row now."""
        self.mask = torch.cat([self.mask, valid], dim=1)
        self.next_pos = self.next_pos + valid.sum(1)

    def add_rows(self, count: int) -> None:
        """Append ``count`` rows with no tokens yet (padding in every column so far)."""
        if self.rows == 0:
            self._reset(count)
            return
        for layer in self._layers():
            keys, values = _tensors(layer)
            _rows, heads, width, dim = keys.shape
            layer.keys = torch.cat([keys, keys.new_zeros(count, heads, width, dim)])
            layer.values = torch.cat([values, values.new_zeros(count, heads, width, dim)])
        self.mask = torch.cat([self.mask, self.mask.new_zeros(count, self.width)])
        self.next_pos = torch.cat([self.next_pos, self.next_pos.new_zeros(count)])

    def repeat(self, count: int) -> None:
        """One row becomes ``count`` copies of it (a prompt prefix several share)."""
        assert self.rows == 1, "repeat a single row"
        for layer in self._layers():
            keys, values = _tensors(layer)
            layer.keys = keys.expand(count, -1, -1, -1).contiguous()
            layer.values = values.expand(count, -1, -1, -1).contiguous()
        self.mask = self.mask.expand(count, -1).contiguous()
        self.next_pos = self.next_pos.expand(count).contiguous()

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows``, in that order."""
        if list(rows) == list(range(self.rows)):
            return
        if not rows:
            self._reset(0)
            return
        self._gather(rows, into=self)

    def take(self, rows: Sequence[int]) -> KvRows:
        """A new batch holding a copy of ``rows`` (this one is unchanged)."""
        taken = KvRows(self._model)
        if rows:
            self._gather(rows, into=taken)
        return taken

    def concat(self, other: KvRows) -> None:
        """Append ``other``'s rows (which it then no longer owns) after these."""
        if other.rows == 0:
            return
        if self.rows == 0:
            self.cache, self.mask, self.next_pos = other.cache, other.mask, other.next_pos
            return
        width = max(self.width, other.width)
        for mine, theirs in zip(self._layers(), other._layers(), strict=True):
            (my_keys, my_values), (their_keys, their_values) = _tensors(mine), _tensors(theirs)
            mine.keys = torch.cat([_left_pad(my_keys, width), _left_pad(their_keys, width)])
            mine.values = torch.cat([_left_pad(my_values, width), _left_pad(their_values, width)])
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(other.mask, width)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])

    def _gather(self, rows: Sequence[int], into: KvRows) -> None:
        index = torch.tensor(list(rows), dtype=torch.long, device=self.mask.device)
        mask = self.mask[index]
        used = mask.any(dim=0)
        columns = None if bool(used.all()) else used.nonzero().squeeze(1)
        for mine, theirs in zip(self._all_layers(), into._all_layers(), strict=True):
            if not mine.is_initialized:
                continue
            keys, values = (tensor[index] for tensor in _tensors(mine))
            if columns is not None:
                keys, values = keys[:, :, columns], values[:, :, columns]
            if not theirs.is_initialized:
                theirs.lazy_initialization(keys, values)
            theirs.keys, theirs.values = keys, values
        into.mask = mask if columns is None else mask[:, columns]
        into.next_pos = self.next_pos[index]

    def _reset(self, rows: int) -> None:
        fresh = KvRows(self._model, rows)
        self.cache, self.mask, self.next_pos = fresh.cache, fresh.mask, fresh.next_pos

    def _all_layers(self) -> list[DynamicLayer]:
        return [layer for layer in self.cache.layers if isinstance(layer, DynamicLayer)]

    def _layers(self) -> list[DynamicLayer]:
        """The layers holding tensors (all of them once a forward has run)."""
        return [layer for layer in self._all_layers() if layer.is_initialized]


def attention_mask(seen_before: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
    """What each of W new queries may see, [rows, 1, W, columns] bool, given the
    columns before (``seen_before`` [rows, C]) and the new ones (``valid`` [rows, W]):
    the real columns, causally over the new ones; a padding query still sees itself
    (never a row with nothing to attend to). None when every row sees every column
    (one new column each and no padding): SDPA then needs no mask."""
    width = valid.shape[1]
    seen = torch.cat([seen_before, valid], dim=1).bool()
    if width == 1 and bool(seen.all()):
        return None
    causal = torch.ones(width, seen.shape[1], dtype=torch.bool, device=seen.device)
    causal = causal.tril(seen.shape[1] - width)
    diagonal = torch.zeros_like(causal)
    diagonal[:, seen.shape[1] - width :] = torch.eye(width, dtype=torch.bool)
    return ((seen[:, None, :] & causal) | diagonal)[:, None]


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys``/``values`` are views of larger buffers: ``update``
    appends in place, and copies into new buffers (with headroom of a quarter of the width,
    so a copy comes once every width/4 steps) only when the room runs out or when
    ``keys``/``values`` were replaced by other tensors (KvRows joins and drops rows)."""

    _buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        width, new = self._width(), key_states.shape[2]
        keys, values = self.room(new, key_states, value_states)
        keys[:, :, width : width + new] = key_states
        values[:, :, width : width + new] = value_states
        return self.extend(new)

    def room(
        self,
        new: int,
        like_keys: torch.Tensor | None = None,
        like_values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers, with room for ``new`` more columns after ``keys``'s (grown into
        new ones where needed; ``like_*``: the shape and dtype of what comes, where the
        layer holds no columns yet)."""
        keys, values = _tensors(self)
        width = self._width()
        buffers = self._buffers
        if buffers is None or not _views_of(keys, buffers[0]) or width + new > buffers[0].shape[2]:
            room = width + new + max(16, (width + new) // 4)
            buffers = (
                _grown(keys, keys if like_keys is None else like_keys, width, room),
                _grown(values, values if like_values is None else like_values, width, room),
            )
            self._buffers = buffers
        return buffers

    def extend(self, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys`` and ``values`` take in the next ``new`` columns of the buffers
        (written there since ``room``)."""
        assert self._buffers is not None, "room before extend"
        width = self._width() + new
        self.keys, self.values = self._buffers[0][:, :, :width], self._buffers[1][:, :, :width]
        return self.keys, self.values

    def _width(self) -> int:
        keys = _tensors(self)[0]
        return keys.shape[2] if keys.dim() == 4 else 0

    def reset(self) -> None:
        self._buffers = None
        super().reset()


def _views_of(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``tensor`` is the leading columns of ``buffer`` (what update left)."""
    return (
        tensor.data_ptr() == buffer.data_ptr()
        and tensor.stride() == buffer.stride()
        and tensor.shape[:2] == buffer.shape[:2]
    )


def _grown(old: torch.Tensor, like: torch.Tensor, width: int, room: int) -> torch.Tensor:
    rows, heads, _new, dim = like.shape
    buffer = like.new_empty(rows, heads, room, dim)
    if width:
        buffer[:, :, :width] = old
    return buffer


def _tensors(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    assert layer.keys is not None and layer.values is not None, "an initialised layer"
    return layer.keys, layer.values


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Pad the column dimension (the last of a mask, the third of keys/values) on the left."""
    dim = 1 if tensor.dim() == 2 else 2
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
