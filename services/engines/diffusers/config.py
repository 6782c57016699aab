"""The diffusers engine's ``engine_args``, validated once when the engine is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from services.mesh.errors import InitFailed

# A request may not ask for a side longer than this unless the stage raises it: one
# huge image would hold the single pipeline thread for minutes.
DEFAULT_MAX_IMAGE_SIZE = 2048


@dataclass(frozen=True)
class DiffusersArgs:
    """Stage defaults for requests, and the shape of the ``load_format: dummy`` pipeline."""

    num_inference_steps: int = 8
    # 1.0 turns classifier-free guidance off: no negative embeddings are needed, which
    # is what an upstream stage handing over ``prompt_embeds`` can provide.
    guidance_scale: float = 1.0
    preview_every: int = 0  # 0: no progress events
    max_image_size: int = DEFAULT_MAX_IMAGE_SIZE
    # How long the oldest waiting request may wait, from its arrival, for others
    # sent with it to share its call (costs a lone request this much latency;
    # nothing with max_batch_size 1).
    gather_ms: float = 10.0
    # Dummy pipeline only (ignored for a real folder).
    cross_attention_dim: int = 32
    sample_size: int = 8  # latent side; the image side is twice this
    dummy_seed: int = 0

    @classmethod
    def from_engine_args(cls, engine_args: Mapping[str, Any]) -> DiffusersArgs:
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in engine_args.items():
            if key not in known:
                names = ", ".join(sorted(known))
                raise InitFailed(
                    f"unknown diffusers engine_args key {key!r} (known: {names})",
                    field=f"engine_args.{key}",
                )
            allowed = (int, float) if known[key].type == "float" else (int,)
            if isinstance(value, bool) or not isinstance(value, allowed):
                kind = "a number" if float in allowed else "an integer"
                raise InitFailed(
                    f"engine_args.{key} must be {kind}, got {value!r}",
                    field=f"engine_args.{key}",
                )
            values[key] = value
        args = cls(**values)
        args._validate()
        return args

    def _validate(self) -> None:
        positive = {
            "num_inference_steps": self.num_inference_steps,
            "max_image_size": self.max_image_size,
            "cross_attention_dim": self.cross_attention_dim,
            "sample_size": self.sample_size,
        }
        for key, value in positive.items():
            if value < 1:
                raise InitFailed(f"engine_args.{key} must be >= 1", field=f"engine_args.{key}")
        if self.preview_every < 0:
            raise InitFailed(
                "engine_args.preview_every must be >= 0", field="engine_args.preview_every"
            )
        if self.gather_ms < 0:
            raise InitFailed("engine_args.gather_ms must be >= 0", field="engine_args.gather_ms")
        if self.guidance_scale < 0:
            raise InitFailed(
                "engine_args.guidance_scale must be >= 0", field="engine_args.guidance_scale"
            )
