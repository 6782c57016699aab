"""Intake validation for diffusion requests: every refusal names the offending field."""

from __future__ import annotations

from services.engines.base import EngineRequest, SamplingParams
from services.engines.diffusers.config import DiffusersArgs
from services.engines.prompt_size import PromptBound
from services.engines.request_checks import (
    TEXT,
    check_seed,
    one_input,
    refuse,
    refuse_unknown_tensors,
)
from services.engines.text_intake import EMBEDS, EMBEDS_FIELD, check_embeds

MAX_STEPS = 1000


def check_request(
    request: EngineRequest,
    params: SamplingParams,
    args: DiffusersArgs,
    embed_dim: int | None,
    bound: PromptBound | None = None,
) -> None:
    """Raise ``InvalidArgument`` unless ``request`` can run with ``params`` (its own
    with the defaults filled in); ``embed_dim`` is the width the denoiser's
    cross-attention expects (None: not known, not checked). ``bound`` refuses a
    text prompt too long to be worth tokenizing: a pipeline cuts the prompt to its
    text encoder's length, but tokenizes all of it first (to warn of the cut), on
    the one thread every request of the stage waits for."""
    refuse_unknown_tensors(request, (EMBEDS,))
    if one_input(request, (TEXT, EMBEDS_FIELD)) == EMBEDS_FIELD:
        check_embeds(request.tensors[EMBEDS], embed_dim)
    elif bound is not None:
        bound.check_text(TEXT, request.text or "")
    steps = params.num_inference_steps
    if steps is not None and not 1 <= steps <= MAX_STEPS:
        refuse("params.num_inference_steps", f"must be in 1..{MAX_STEPS}, got {steps}")
    for name in ("height", "width"):
        side = getattr(params, name)
        if side is not None and (side < 8 or side % 8 or side > args.max_image_size):
            refuse(
                f"params.{name}",
                f"must be a positive multiple of 8 up to {args.max_image_size}, got {side}",
            )
    if params.preview_every is not None and params.preview_every < 0:
        refuse("params.preview_every", f"must be >= 0, got {params.preview_every}")
    if params.guidance_scale is not None and params.guidance_scale < 0:
        refuse("params.guidance_scale", f"must be >= 0, got {params.guidance_scale}")
    check_seed(params.seed)
