"""The diffusers engine's ``engine_args`` (its settings model)."""

from __future__ import annotations

from pydantic import Field

from services.engines.defaults import RequestDefaults
from services.engines.engine_args import EngineArgs

# A request may not ask for a side longer than this unless the stage raises it: one
# huge image would hold the single pipeline thread for minutes.
DEFAULT_MAX_IMAGE_SIZE = 2048

BUILT_IN = RequestDefaults(
    num_inference_steps=8,
    # 1.0 turns classifier-free guidance off: no negative embeddings are needed, which
    # is what an upstream stage handing over ``prompt_embeds`` can provide.
    guidance_scale=1.0,
    preview_every=0,  # no progress events
)


class DiffusersArgs(EngineArgs):
    """Defaults for requests, limits, and the shape of the ``load_format: dummy`` pipeline."""

    # What a request that leaves these unset gets (unset here: BUILT_IN; the stage
    # file's `defaults:` wins over both, see services/engines/defaults.py).
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0, allow_inf_nan=False)
    preview_every: int | None = Field(None, ge=0)
    max_image_size: int = Field(DEFAULT_MAX_IMAGE_SIZE, ge=8)
    # How long the oldest waiting request may wait, from its arrival, for others
    # sent with it to share its call (costs a lone request this much latency;
    # nothing with max_batch_size 1).
    gather_ms: float = Field(10.0, ge=0, allow_inf_nan=False)
    # Dummy pipeline only (ignored for a real folder).
    cross_attention_dim: int = Field(32, ge=1)
    sample_size: int = Field(8, ge=1)  # latent side; the image side is twice this
    dummy_seed: int = 0

    @property
    def request_defaults(self) -> RequestDefaults:
        """This layer of the defaults (defaults.resolve)."""
        return RequestDefaults(
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            preview_every=self.preview_every,
        )
