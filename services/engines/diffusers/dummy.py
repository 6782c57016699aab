"""A tiny random-weight text-to-image pipeline built from config alone.

``load_format: dummy`` serves it, and tests ``save_pretrained`` it to stand in for a
real local pipeline folder: no files are read and nothing is fetched.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

# Defining modules, not diffusers' lazy top-level names: type checkers see real classes.
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import (
    StableDiffusionPipeline,
)
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
# Prompts are cut to this many tokens; the text encoder has as many positions.
MAX_PROMPT_TOKENS = 32


def build_byte_tokenizer(model_max_length: int = MAX_PROMPT_TOKENS) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges: any text encodes, one token per byte, so
    different prompts condition the dummy model differently."""
    vocab = {token: i for i, token in enumerate(_SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=model_max_length,
    )


def build_dummy_pipeline(
    *,
    cross_attention_dim: int = 32,
    sample_size: int = 8,
    seed: int = 0,
    torch_dtype: torch.dtype = torch.float32,
) -> StableDiffusionPipeline:
    """A Stable-Diffusion-shaped pipeline of about a million random parameters.

    ``sample_size`` is the latent side; the VAE doubles it, so the native image is
    ``2 * sample_size`` pixels square. The same ``seed`` gives the same weights.
    """
    tokenizer = build_byte_tokenizer()
    heads = 4 if cross_attention_dim % 4 == 0 else 1
    text_config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=cross_attention_dim,
        intermediate_size=2 * cross_attention_dim,
        num_hidden_layers=2,
        num_attention_heads=heads,
        max_position_embeddings=MAX_PROMPT_TOKENS,
        projection_dim=cross_attention_dim,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # Fork the RNG so building a pipeline does not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=sample_size,
            in_channels=4,
            out_channels=4,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=cross_attention_dim,
            attention_head_dim=8,
            norm_num_groups=32,
        )
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            block_out_channels=(32, 64),
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=32,
            sample_size=2 * sample_size,
        )
        text_encoder = CLIPTextModel(text_config)
    # "trailing" spacing keeps every timestep in range for any step count up to
    # num_train_timesteps ("leading" with steps_offset=1 overruns at 1000 steps).
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        timestep_spacing="trailing",
    )
    # Through a dict: diffusers' annotations want CLIPTokenizer and refuse the None
    # components that the pipeline itself accepts.
    components: dict[str, Any] = {
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "unet": unet,
        "scheduler": scheduler,
        "safety_checker": None,
        "feature_extractor": None,
    }
    pipe = StableDiffusionPipeline(**components, requires_safety_checker=False)
    logger.debug("built dummy pipeline (cross_attention_dim=%s)", cross_attention_dim)
    return pipe.to(dtype=torch_dtype)
