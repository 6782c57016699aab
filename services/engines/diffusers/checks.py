"""Intake validation for diffusion requests: every refusal names the offending field."""

from __future__ import annotations

from services.engines.base import EngineRequest
from services.engines.diffusers.config import DiffusersArgs
from services.engines.prompt_size import PromptBound
from services.mesh.errors import InvalidArgument

MAX_STEPS = 1000
PROMPT_EMBEDS = "prompt_embeds"
_EMBEDS_FIELD = f"inputs.tensors.{PROMPT_EMBEDS}"


def check_request(
    request: EngineRequest,
    args: DiffusersArgs,
    embed_dim: int | None,
    bound: PromptBound | None = None,
) -> None:
    """Raise ``InvalidArgument`` unless ``request`` can run; ``embed_dim`` is the width
    the denoiser's cross-attention expects (None: not known, not checked). ``bound``
    refuses a text prompt too long to be worth tokenizing: a pipeline cuts the prompt
    to its text encoder's length, but tokenizes all of it first (to warn of the cut),
    on the one thread every request of the stage waits for."""
    _check_inputs(request, embed_dim)
    if bound is not None and request.text is not None:
        bound.check_text("inputs.text", request.text)
    params = request.params
    steps = params.num_inference_steps
    if steps is not None and not 1 <= steps <= MAX_STEPS:
        raise InvalidArgument(
            f"num_inference_steps must be in 1..{MAX_STEPS}, got {steps}",
            field="params.num_inference_steps",
        )
    for name in ("height", "width"):
        side = getattr(params, name)
        if side is None:
            continue
        if side < 8 or side % 8 or side > args.max_image_size:
            raise InvalidArgument(
                f"{name} must be a positive multiple of 8 up to {args.max_image_size}, got {side}",
                field=f"params.{name}",
            )
    if params.preview_every is not None and params.preview_every < 0:
        raise InvalidArgument(
            f"preview_every must be >= 0, got {params.preview_every}",
            field="params.preview_every",
        )
    if params.guidance_scale is not None and params.guidance_scale < 0:
        raise InvalidArgument(
            f"guidance_scale must be >= 0, got {params.guidance_scale}",
            field="params.guidance_scale",
        )
    if params.seed is not None and not 0 <= params.seed < 2**63:
        raise InvalidArgument(f"seed must be in 0..2**63-1, got {params.seed}", field="params.seed")


def _check_inputs(request: EngineRequest, embed_dim: int | None) -> None:
    if request.messages:
        raise InvalidArgument("the diffusers engine takes no messages", field="inputs.messages")
    if request.token_ids:
        raise InvalidArgument("the diffusers engine takes no token ids", field="inputs.token_ids")
    for name in request.tensors:
        if name != PROMPT_EMBEDS:
            raise InvalidArgument(
                f"unknown input tensor {name!r} (expected {PROMPT_EMBEDS!r})",
                field=f"inputs.tensors.{name}",
            )
    embeds = request.tensors.get(PROMPT_EMBEDS)
    has_text = request.text is not None
    if has_text == (embeds is not None):
        raise InvalidArgument(
            f"give either text or a {PROMPT_EMBEDS} tensor, not both or neither", field="inputs"
        )
    if embeds is None:
        return
    if not embeds.is_floating_point():
        raise InvalidArgument(
            f"{PROMPT_EMBEDS} must be a float tensor, got {embeds.dtype}", field=_EMBEDS_FIELD
        )
    shape = tuple(embeds.shape)
    if not (len(shape) == 2 or (len(shape) == 3 and shape[0] == 1)) or shape[-2] == 0:
        raise InvalidArgument(
            f"{PROMPT_EMBEDS} must be [seq, dim] or [1, seq, dim] with seq > 0, got {list(shape)}",
            field=_EMBEDS_FIELD,
        )
    if embed_dim is not None and shape[-1] != embed_dim:
        raise InvalidArgument(
            f"{PROMPT_EMBEDS} last dim must be {embed_dim} (the model's cross-attention width), "
            f"got {shape[-1]}",
            field=_EMBEDS_FIELD,
        )
