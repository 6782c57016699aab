"""A tiny Qwen3-Omni checkpoint with random weights, built from a config here.

The real classes (thinker, talker with its code predictor, code2wav) at a few
hundred thousand parameters, seeded, saved as an ordinary Hugging Face folder
with a processor whose tokenizer is built in memory (byte-level, the special
tokens the model reads): nothing is downloaded. Tests and ``omni up`` on a
machine without the real weights serve it; its text and audio are noise, but
every hand-off between the parts is the real one. The config values and the
traps they get past are in the comments below (docs/qwen3-omni.md, "The tiny
checkpoint", says what the checkpoint is for).

    python -m services.engines.qwen_omni.tiny FOLDER
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from services.engines.qwen_omni import processor

# Token ids: the 256 bytes, then these (the order of SPECIAL below).
SPECIAL = (
    "user", "assistant", "system", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>", "<|vision_start|>",
    "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|tts_pad|>", "<|tts_bos|>",
    "<|tts_eos|>",
)  # fmt: skip
IDS = {token: 256 + i for i, token in enumerate(SPECIAL)}
SEED = 0
# Weights drawn ten times wider than transformers' 0.02: at 0.02 a model this small
# answers every prompt alike and its talker ignores the text it is given, so a
# broken hand-off would go unseen. code2wav keeps 0.02 (wider, its audio clips).
SCALE = 0.2
C2W_SCALE = 0.1

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Sizes a benchmark can ask for. "tiny" (the default: tests, `omni up`) is a few
# hundred thousand parameters; "small" is big enough that compute, not the mesh's
# per-step costs, dominates (benchmarks/omni_concurrency.py): thinker 512 wide, 8
# layers, 8 experts; talker, code predictor and code2wav scaled alike. The real
# model: thinker 2048 x 48 layers x 128 experts, 16 code groups, 1920 samples a code.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8,
             "experts": 4, "expert_ffn": 16, "talker_hidden": 32, "talker_layers": 2,
             "talker_heads": 4, "talker_head_dim": 8, "talker_expert_ffn": 16,
             "shared_ffn": 32, "predictor_layers": 1, "groups": 4, "codebook": 32,
             "wav_hidden": 32, "wav_layers": 1, "wav_upsample": [2, 2], "wav_ratios": [2],
             "decoder_dim": 16, "mrope": [2, 1, 1]},
    "small": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2, "head_dim": 64,
              "experts": 8, "expert_ffn": 256, "talker_hidden": 256, "talker_layers": 4,
              "talker_heads": 4, "talker_head_dim": 64, "talker_expert_ffn": 128,
              "shared_ffn": 256, "predictor_layers": 2, "groups": 8, "codebook": 256,
              "wav_hidden": 256, "wav_layers": 2, "wav_upsample": [4, 4], "wav_ratios": [2, 2],
              "decoder_dim": 64, "mrope": [16, 8, 8]},
}  # fmt: skip


def config(size: str = "tiny") -> Any:
    """The ``Qwen3OmniMoeConfig`` of a checkpoint of ``size`` (SIZES)."""
    from transformers import Qwen3OmniMoeConfig

    z = SIZES[size]
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": z["mrope"],
            "interleaved": True}  # fmt: skip
    moe = {"initializer_range": SCALE, "hidden_size": z["hidden"],
           "intermediate_size": 2 * z["hidden"], "num_hidden_layers": z["layers"],
           "num_attention_heads": z["heads"], "num_key_value_heads": z["kv_heads"],
           "head_dim": z["head_dim"], "moe_intermediate_size": z["expert_ffn"],
           "num_experts": z["experts"], "num_experts_per_tok": 2,
           "rope_parameters": rope}  # fmt: skip
    talker_moe = {**moe, "hidden_size": z["talker_hidden"],
                  "intermediate_size": 2 * z["talker_hidden"],
                  "num_hidden_layers": z["talker_layers"],
                  "num_attention_heads": z["talker_heads"], "head_dim": z["talker_head_dim"],
                  "moe_intermediate_size": z["talker_expert_ffn"]}  # fmt: skip
    media = {"audio_token_id": IDS["<|audio_pad|>"], "image_token_id": IDS["<|image_pad|>"],
             "video_token_id": IDS["<|video_pad|>"],
             "audio_start_token_id": IDS["<|audio_start|>"],
             "vision_start_token_id": IDS["<|vision_start|>"]}  # fmt: skip
    audio = {"num_mel_bins": 128, "encoder_layers": 1, "encoder_attention_heads": 2,
             "encoder_ffn_dim": 32, "d_model": 16, "n_window": 50, "n_window_infer": 100,
             "downsample_hidden_size": 8, "output_dim": z["hidden"]}  # fmt: skip
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "out_hidden_size": z["hidden"], "num_position_embeddings": 64,
              "deepstack_visual_indexes": [0]}  # fmt: skip
    thinker = {"text_config": {**moe, "vocab_size": 288}, "audio_config": audio,
               "vision_config": vision, "user_token_id": IDS["user"], **media}  # fmt: skip
    codebook = z["codebook"]
    predictor = {"vocab_size": codebook, "hidden_size": z["talker_hidden"],
                 "intermediate_size": 2 * z["talker_hidden"],
                 "num_hidden_layers": z["predictor_layers"],
                 "num_attention_heads": z["talker_heads"], "num_key_value_heads": 2,
                 "head_dim": z["talker_head_dim"], "num_code_groups": z["groups"]}  # fmt: skip
    # The talker's top 1024 ids are special and never generated (but the end), as in
    # the real model: its vocabulary is the codebook plus those 1024.
    talker = {
        "text_config": {**talker_moe, "vocab_size": codebook + 1024,
                        "shared_expert_intermediate_size": z["shared_ffn"]},
        "code_predictor_config": predictor,
        "num_code_groups": z["groups"], "thinker_hidden_size": z["hidden"],
        "accept_hidden_layer": z["layers"],
        "codec_pad_id": codebook, "codec_bos_id": codebook + 1,
        "codec_eos_token_id": codebook + 2, "codec_nothink_id": codebook + 3,
        "codec_think_bos_id": codebook + 4, "codec_think_eos_id": codebook + 5,
        "speaker_id": {"ethan": codebook + 6, "chelsie": codebook + 7},
        "spatial_merge_size": 2, **media,
    }  # fmt: skip
    code2wav = {"codebook_size": codebook, "hidden_size": z["wav_hidden"],
                "num_attention_heads": 4, "num_key_value_heads": 4, "sliding_window": 72,
                "intermediate_size": 2 * z["wav_hidden"], "num_hidden_layers": z["wav_layers"],
                "num_quantizers": z["groups"], "upsample_rates": z["wav_upsample"],
                "upsampling_ratios": z["wav_ratios"], "decoder_dim": z["decoder_dim"]}  # fmt: skip
    parts: tuple[dict[str, Any], ...] = (audio, vision, thinker, talker, predictor)
    for part in parts:
        part["initializer_range"] = SCALE
    code2wav["initializer_range"] = C2W_SCALE
    cfg = Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
        im_start_token_id=IDS["<|im_start|>"], im_end_token_id=IDS["<|im_end|>"],
        tts_pad_token_id=IDS["<|tts_pad|>"], tts_bos_token_id=IDS["<|tts_bos|>"],
        tts_eos_token_id=IDS["<|tts_eos|>"], system_token_id=IDS["system"],
        user_token_id=IDS["user"], assistant_token_id=IDS["assistant"],
    )  # fmt: skip
    # Read by get_rope_index but not declared by the thinker's config (trap: undeclared key).
    setattr(cfg.thinker_config, "vision_start_token_id", IDS["<|vision_start|>"])  # noqa: B010
    return cfg


def build_model(seed: int = SEED, size: str = "tiny") -> Any:
    """The whole model, every weight drawn under ``seed`` (the same model on every build)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config(size))
    # The talker's MoE experts are left as torch.empty by _init_weights: garbage
    # that differs from one build to the next unless drawn here.
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.talker.named_parameters()):
        if ".experts." in name:
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=generator) * SCALE)
    return model.eval()


def build_processor() -> Any:
    """The processor: byte-level tokenizer with the special tokens, image and audio
    front ends, no video processor (it needs torchvision, broken beside CPU torch)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLImageProcessorPil,
        WhisperFeatureExtractor,
    )

    vocab = {char: i for i, char in enumerate(_byte_chars())}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_tokens(list(SPECIAL[:3]))
    bpe.add_special_tokens(list(SPECIAL[3:]))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "audio_token": "<|audio_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
    )
    image = Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32, max_pixels=64 * 64
    )
    audio = WhisperFeatureExtractor(feature_size=128)
    return processor.make(tokenizer, image, audio, CHAT_TEMPLATE)


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order (what ByteLevel emits)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def save(folder: Path, seed: int = SEED, size: str = "tiny") -> Path:
    """Build and save the checkpoint (model + processor) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    build_model(seed, size).save_pretrained(folder)
    processor.save(build_processor(), folder)
    marker = {"seed": seed, "random": True, "size": size}
    (folder / "omni-tiny.json").write_text(json.dumps(marker))
    return folder


def ensure(cache_dir: Path, seed: int = SEED, size: str = "tiny") -> Path:
    """The checkpoint under ``cache_dir``, built there once: what a stage with
    ``load_format: dummy`` serves (tiny). Three stages may start at once; each builds
    into its own folder and the first rename wins (the builds are identical)."""
    folder = cache_dir / f"qwen3-omni-{size}-seed{seed}"
    if (folder / "omni-tiny.json").is_file():
        return folder
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".{size}-") as scratch:
        built = save(Path(scratch) / "model", seed, size)
        with contextlib.suppress(OSError):  # another stage was first
            built.rename(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = parser.parse_args()
    print(save(args.folder, args.seed, args.size))


if __name__ == "__main__":
    main()
