"""The settings models of the video engines (``engine_args``): the upscaler's
(``VideoArgs``) and the test-pattern source's (``SourceArgs``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from services.engines.engine_args import EngineArgs, StageFacts

Mode = Literal["off", "basic", "aggressive"]
MAX_FRAMES = 4096


@dataclass(frozen=True)
class ModelShape:
    """The shape of the seeded random windowed upscaler (``load_format: dummy``)."""

    dim: int = 32
    heads: int = 2
    blocks: int = 4
    patch: int = 2  # input pixels per token side
    scale: int = 2  # output side = input side * scale
    window_frames: int = 4  # frames per model window
    kv_windows: int = 2  # past windows each block attends to (its KV cache length)
    seed: int = 0


_SHAPE = ModelShape()


class VideoArgs(EngineArgs):
    """Where the model runs, how its windows overlap, and the model's shape (flat
    keys: ``dim``, ``heads``, ``blocks``, ... as in ``ModelShape``).

    ``devices``: the two devices the blocks are split over (``cpu`` twice for
    two in-order CPU queues; ``cuda:0`` twice for two streams of one GPU);
    unset, the stage's ``runtime.device`` twice.
    ``split``: the last block on device 0; ``auto`` is ``blocks // 2 - 1``.
    ``emulated_block_ms``: a GIL-releasing wait after every block's work, to
    show the schedule's overlap where real compute cannot (benchmarks, demos).
    """

    devices: tuple[str, str]
    mode: Mode = "aggressive"
    emulated_block_ms: float = Field(0.0, ge=0, allow_inf_nan=False)
    max_streams: int = Field(16, ge=1)  # requests whose window state the engine keeps at once
    stream_idle_s: float = Field(300.0, ge=0)  # a request's state unused this long is dropped
    # The model's shape; heads before dim and blocks before split: their checks read them.
    heads: int = Field(_SHAPE.heads, ge=1)
    dim: int = Field(_SHAPE.dim, ge=1)
    blocks: int = Field(_SHAPE.blocks, ge=1)
    split: int | Literal["auto"] = "auto"
    patch: int = Field(_SHAPE.patch, ge=1)
    scale: int = Field(_SHAPE.scale, ge=1)
    window_frames: int = Field(_SHAPE.window_frames, ge=1)
    kv_windows: int = Field(_SHAPE.kv_windows, ge=1)
    seed: int = Field(_SHAPE.seed, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _stage_device_twice(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict) and "devices" not in data:
            device = StageFacts.of(info).device
            return {**data, "devices": (device, device)}
        return data

    @field_validator("devices", mode="before")
    @classmethod
    def _two_of_a_kind(cls, devices: Any) -> Any:
        if not isinstance(devices, list | tuple) or len(devices) != 2:
            raise ValueError("expected a list of two devices")
        for device in devices:
            if not isinstance(device, str):
                raise ValueError(f"expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
            if device not in ("cpu", "cuda") and not (
                device.startswith("cuda:") and device[5:].isdigit()
            ):
                raise ValueError(f"expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        if (devices[0] == "cpu") != (devices[1] == "cpu"):
            raise ValueError(f"expected both CPU or both CUDA, got {list(devices)}")
        return devices

    @field_validator("dim")
    @classmethod
    def _whole_heads(cls, dim: int, info: ValidationInfo) -> int:
        heads = info.data.get("heads")
        if heads and dim % heads:
            raise ValueError(f"expected a multiple of heads ({heads})")
        return dim

    @field_validator("blocks")
    @classmethod
    def _two_devices(cls, blocks: int) -> int:
        if blocks < 2:
            raise ValueError("expected at least 2 (blocks are split over two devices)")
        return blocks

    @field_validator("split", mode="before")
    @classmethod
    def _inside(cls, split: Any, info: ValidationInfo) -> Any:
        blocks = info.data.get("blocks", _SHAPE.blocks)
        whole = isinstance(split, int) and not isinstance(split, bool)
        if split != "auto" and not (whole and 0 <= split <= blocks - 2):
            raise ValueError(f"expected auto or a block in 0..{blocks - 2}")
        return split

    @property
    def shape(self) -> ModelShape:
        return ModelShape(**{f.name: getattr(self, f.name) for f in fields(ModelShape)})

    @property
    def split_index(self) -> int:
        """The last block on device 0, in ``[0, blocks - 2]``."""
        last = self.blocks - 2
        wanted = self.blocks // 2 - 1 if self.split == "auto" else self.split
        return min(max(wanted, 0), last)


class SourceArgs(EngineArgs):
    """The test-pattern source's ``engine_args``."""

    frames: int = Field(16, ge=1, le=MAX_FRAMES)  # per request, unless it sets extra.frames
    window_frames: int = Field(4, ge=1, le=MAX_FRAMES)  # frames per segment
    height: int = Field(32, ge=1, le=MAX_FRAMES)
    width: int = Field(32, ge=1, le=MAX_FRAMES)
