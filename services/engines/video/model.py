"""A small deterministic windowed video upscaler with seeded random weights.

The structure of a streaming video super-resolution model (FlashVSR-style),
small enough for a CPU test: a stateful input projection (each frame is
embedded with its difference to the frame before, across window borders),
per-window noise and position offsets, transformer blocks that attend to the
current window and to the keys/values of earlier windows (each block's KV cache
lives on the block's device), a head that turns every token into an
upscaled pixel patch on top of a bilinear upscale, and a stateful decoder that
blends each frame with the one decoded before it.

Everything stateful is written in window order; a KV cache refuses a write out
of order, since that would silently change every later window's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from services.engines.video.config import ModelShape


class WindowOrderError(RuntimeError):
    """A stateful part was asked to take a window out of order."""


@dataclass
class KvCache:
    """One block's keys/values of the last ``keep`` windows, on the block's device."""

    keep: int
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    next_window: int = 0
    check_order: bool = True

    def context(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([*self.keys, k]), torch.cat([*self.values, v])

    def write(self, window: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.check_order and window != self.next_window:
            raise WindowOrderError(
                f"KV cache write for window {window}, expected window {self.next_window}"
            )
        self.next_window = window + 1
        self.keys = [*self.keys, k][-self.keep :]
        self.values = [*self.values, v][-self.keep :]


@dataclass
class StreamState:
    """Everything one request's stream carries from window to window."""

    kv: list[KvCache]
    check_order: bool = True
    previous_frame: torch.Tensor | None = None  # input projection, on device 0
    embedded: int = 0  # next window the input projection expects
    previous_output: torch.Tensor | None = None  # decoder, on device 1
    decoded: int = 0  # next window the decoder expects
    windows: int = 0  # windows assigned so far (host side, in arrival order)
    frames: int = 0  # frames assigned so far: the next window's position offset
    frame_size: tuple[int, int] | None = None  # (H, W) of every frame of the stream

    def advance(self, part: str, window: int, expected: int) -> int:
        if self.check_order and window != expected:
            raise WindowOrderError(f"{part} got window {window}, expected window {expected}")
        return window + 1


@dataclass(frozen=True)
class Block:
    qkv: torch.Tensor  # [dim, 3 dim]
    out: torch.Tensor  # [dim, dim]
    up: torch.Tensor  # [dim, 4 dim]
    down: torch.Tensor  # [4 dim, dim]

    def to(self, device: torch.device) -> Block:
        return Block(*(t.to(device) for t in (self.qkv, self.out, self.up, self.down)))


@dataclass(frozen=True)
class Weights:
    embed: torch.Tensor  # [6 p p, dim]: frame and temporal difference, per patch
    blocks: tuple[Block, ...]
    head: torch.Tensor  # [dim, 3 (p s)^2]

    @property
    def nbytes(self) -> int:
        tensors = [self.embed, self.head]
        for b in self.blocks:
            tensors += [b.qkv, b.out, b.up, b.down]
        return sum(t.numel() * t.element_size() for t in tensors)


def build_weights(shape: ModelShape) -> Weights:
    """Seeded random weights on the CPU (placed on devices by the caller)."""
    gen = torch.Generator().manual_seed(shape.seed)
    d = shape.dim

    def rand(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / math.sqrt(rows)

    blocks = tuple(
        Block(rand(d, 3 * d), rand(d, d), rand(d, 4 * d), rand(4 * d, d))
        for _ in range(shape.blocks)
    )
    out_patch = shape.patch * shape.scale
    head = rand(d, 3 * out_patch * out_patch) * 0.1  # small detail on top of the bilinear base
    return Weights(rand(6 * shape.patch * shape.patch, d), blocks, head)


def new_state(shape: ModelShape, check_order: bool = True) -> StreamState:
    """``check_order=False`` only for the test that shows why the checks exist."""
    caches = [KvCache(shape.kv_windows, check_order=check_order) for _ in range(shape.blocks)]
    return StreamState(caches, check_order=check_order)


def window_seed(shape: ModelShape, request_seed: int, window: int) -> int:
    """Fixed per window, whatever the schedule."""
    return (shape.seed * 1_000_003 + request_seed * 7_919 + window) % (2**63)


def embed(
    shape: ModelShape,
    embed_w: torch.Tensor,
    state: StreamState,
    window: int,
    frames: torch.Tensor,
    frame_offset: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage A: uint8 frames [F, 3, H, W] -> tokens [F*h*w, dim] and the float
    frames (the head's bilinear base), on ``embed_w``'s device."""
    state.embedded = state.advance("the input projection", window, state.embedded)
    device = embed_w.device
    x = frames.to(device).float() / 255.0
    previous = x[:1] if state.previous_frame is None else state.previous_frame
    state.previous_frame = x[-1:]
    diff = x - torch.cat([previous, x[:-1]])
    p = shape.patch
    n = x.shape[0]
    patches = F.unfold(torch.cat([x, diff], dim=1), kernel_size=p, stride=p)  # [F, 6pp, hw]
    tokens = patches.transpose(1, 2) @ embed_w  # [F, hw, dim]
    noise = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(seed))
    # Frame positions run on across windows: the window's offset is fixed when it arrives.
    positions = (
        _sinusoid(frame_offset, n, shape.dim)[:, None]
        + _sinusoid(0, tokens.shape[1], shape.dim)[None]
    )
    tokens = tokens + 0.02 * noise.to(device) + positions.to(device)
    return tokens.reshape(-1, shape.dim), x


def _sinusoid(offset: int, count: int, dim: int) -> torch.Tensor:
    """Sinusoidal embeddings [count, dim] of positions offset .. offset + count - 1."""
    position = torch.arange(offset, offset + count, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(1e4) / dim))
    table = torch.zeros(count, dim)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq)
    return table


def run_block(
    shape: ModelShape, block: Block, cache: KvCache, window: int, x: torch.Tensor
) -> torch.Tensor:
    """Stage B/C: one block over a window's tokens, attending to its KV cache,
    then writing this window's keys/values to it."""
    d, heads = shape.dim, shape.heads
    h = F.layer_norm(x, (d,))
    q, k, v = (h @ block.qkv).split(d, dim=-1)
    keys, values = cache.context(k, v)
    split = (-1, heads, d // heads)
    attn = F.scaled_dot_product_attention(
        q.reshape(split).transpose(0, 1),
        keys.reshape(split).transpose(0, 1),
        values.reshape(split).transpose(0, 1),
    )
    x = x + attn.transpose(0, 1).reshape(-1, d) @ block.out
    x = x + F.gelu(F.layer_norm(x, (d,)) @ block.up) @ block.down
    cache.write(window, k, v)
    return x


def head_and_decode(
    shape: ModelShape,
    head_w: torch.Tensor,
    state: StreamState,
    window: int,
    x: torch.Tensor,
    frames: torch.Tensor,
) -> torch.Tensor:
    """Stage C's end: tokens -> upscaled frames, blended with the frame decoded
    before (the stateful decoder) -> uint8 [F, 3, sH, sW]."""
    state.decoded = state.advance("the decoder", window, state.decoded)
    n, _, height, width = frames.shape
    s, p = shape.scale, shape.patch
    detail = F.layer_norm(x, (shape.dim,)) @ head_w  # [F*hw, 3 (ps)^2]
    detail = detail.reshape(n, -1, detail.shape[-1]).transpose(1, 2)
    detail = F.fold(detail, (height * s, width * s), kernel_size=p * s, stride=p * s)
    base = F.interpolate(frames, scale_factor=s, mode="bilinear", align_corners=False)
    upscaled = base + detail
    decoded = []
    previous = state.previous_output
    for frame in upscaled:
        frame = frame if previous is None else 0.8 * frame + 0.2 * previous
        decoded.append(frame)
        previous = frame
    state.previous_output = previous
    out = torch.stack(decoded).clamp(0.0, 1.0) * 255.0
    return out.round().to(torch.uint8)
