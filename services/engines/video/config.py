"""The video engine's ``engine_args``, validated once when the engine is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, cast

from services.mesh.errors import InitFailed

Mode = Literal["off", "basic", "aggressive"]
MODES: tuple[Mode, ...] = ("off", "basic", "aggressive")


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


@dataclass(frozen=True)
class VideoArgs:
    """Where the model runs and how its windows overlap.

    ``devices``: the two devices the blocks are split over (``cpu`` twice for
    two in-order CPU queues; ``cuda:0`` twice for two streams of one GPU).
    ``split``: the last block on device 0; ``auto`` is ``blocks // 2 - 1``.
    ``emulated_block_ms``: a GIL-releasing wait after every block's work, to
    show the schedule's overlap where real compute cannot (benchmarks, demos).
    """

    devices: tuple[str, str] = ("cpu", "cpu")
    mode: Mode = "aggressive"
    split: int | Literal["auto"] = "auto"
    shape: ModelShape = ModelShape()
    emulated_block_ms: float = 0.0
    max_streams: int = 16  # requests whose window state the engine keeps at once
    stream_idle_s: float = 300.0  # a request's state unused this long is dropped

    @property
    def split_index(self) -> int:
        """The last block on device 0, in ``[0, blocks - 2]``."""
        last = self.shape.blocks - 2
        wanted = self.shape.blocks // 2 - 1 if self.split == "auto" else self.split
        return min(max(wanted, 0), last)

    @classmethod
    def from_engine_args(cls, engine_args: Mapping[str, Any], device: str = "cpu") -> VideoArgs:
        shape_keys = {f.name for f in fields(ModelShape)}
        own_keys = {"devices", "mode", "split", "emulated_block_ms", "max_streams", "stream_idle_s"}
        values: dict[str, Any] = {"devices": (device, device)}
        shape: dict[str, int] = {}
        for key, value in engine_args.items():
            where = f"engine_args.{key}"
            if key in shape_keys:
                shape[key] = _int(value, where, low=0 if key == "seed" else 1)
            elif key == "devices":
                values[key] = _devices(value)
            elif key == "mode":
                if value not in MODES:
                    raise InitFailed(f"{where} must be one of {', '.join(MODES)}", field=where)
                values[key] = cast(Mode, value)
            elif key == "split":
                values[key] = value if value == "auto" else _int(value, where, low=0)
            elif key in ("emulated_block_ms", "stream_idle_s"):
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise InitFailed(f"{where} must be a number >= 0, got {value!r}", field=where)
                values[key] = float(value)
            elif key == "max_streams":
                values[key] = _int(value, where, low=1)
            else:
                known = ", ".join(sorted(shape_keys | own_keys))
                raise InitFailed(
                    f"unknown video engine_args key {key!r} (known: {known})", field=where
                )
        args = cls(shape=ModelShape(**shape), **values)
        args._validate()
        return args

    def _validate(self) -> None:
        shape = self.shape
        if shape.blocks < 2:
            raise InitFailed(
                "engine_args.blocks must be >= 2 (blocks are split over two devices)",
                field="engine_args.blocks",
            )
        if shape.dim % shape.heads:
            raise InitFailed(
                f"engine_args.dim ({shape.dim}) must be a multiple of heads ({shape.heads})",
                field="engine_args.dim",
            )
        if self.split != "auto" and not 0 <= self.split <= shape.blocks - 2:
            raise InitFailed(
                f"engine_args.split must be auto or in 0..{shape.blocks - 2}, got {self.split}",
                field="engine_args.split",
            )


def _int(value: Any, where: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InitFailed(f"{where} must be an integer >= {low}, got {value!r}", field=where)
    return value


def _devices(value: Any) -> tuple[str, str]:
    where = "engine_args.devices"
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise InitFailed(f"{where} must list two devices, got {value!r}", field=where)
    for device in value:
        if not isinstance(device, str) or not (
            device == "cpu" or (device.startswith("cuda:") and device[5:].isdigit())
        ):
            raise InitFailed(f"{where}: expected 'cpu' or 'cuda:N', got {device!r}", field=where)
    if (value[0] == "cpu") != (value[1] == "cpu"):
        raise InitFailed(f"{where}: both CPU or both CUDA, got {list(value)}", field=where)
    return (value[0], value[1])
