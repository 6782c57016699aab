"""Image helpers for the diffusers engine: cheap previews from latents, and PNG."""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

PREVIEW_MAX_SIDE = 64


def latent_preview(latents: torch.Tensor, max_side: int = PREVIEW_MAX_SIDE) -> torch.Tensor | None:
    """A uint8 [h, w, 3] glimpse of the first image's latents, without a VAE decode.

    The first three channels are each stretched to 0..255; a decode per preview would
    cost as much as several denoising steps. Packed (non-spatial) latents give None.
    """
    if latents.ndim != 4 or latents.shape[1] < 1:
        return None
    x = latents[0, :3].detach().float()
    if x.shape[0] < 3:  # fewer channels than colours: grey
        x = x[:1].expand(3, -1, -1)
    height, width = x.shape[1:]
    scale = min(1.0, max_side / max(height, width))
    if scale < 1.0:
        size = (max(1, round(height * scale)), max(1, round(width * scale)))
        x = F.interpolate(x[None], size=size, mode="area")[0]
    low = x.amin(dim=(1, 2), keepdim=True)
    high = x.amax(dim=(1, 2), keepdim=True)
    x = (x - low) / (high - low).clamp_min(1e-6)
    return (x * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous().cpu()


def to_uint8_image(image: np.ndarray) -> torch.Tensor:
    """A pipeline's float [H, W, 3] image in 0..1 → a uint8 [H, W, 3] CPU tensor."""
    array = np.clip(np.rint(image * 255.0), 0, 255).astype(np.uint8)
    return torch.from_numpy(array)


def encode_png(image: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()
