"""The talker's inputs from what the thinker handed over: the monolithic
``Qwen3OmniMoeForConditionalGeneration.generate``'s step 2 ("Prepare talker
input") for one request, reading the tensors of config.py instead of the
thinker's generate result. Kept line for line with transformers 5.24 so the
talker's codes equal the monolithic model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Handoff:
    """What the thinker gave one request (batch of one)."""

    prompt_ids: torch.Tensor  # [S] int64
    answer_ids: torch.Tensor  # [A] int64, the generated tokens (the end token included)
    embed: torch.Tensor  # [S + A - 1, H], thinker layer 0
    hidden: torch.Tensor  # [S + A - 1, H], thinker layer accept_hidden_layer
    tts: torch.Tensor  # [3, H]: tts_bos, tts_eos, tts_pad, the thinker's embeddings
    image_grid_thw: torch.Tensor | None = None
    audio_feature_lengths: torch.Tensor | None = None

    def to(self, device: str) -> Handoff:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.to(device) if t is not None else None

        return Handoff(
            self.prompt_ids.to(device), self.answer_ids.to(device), self.embed.to(device),
            self.hidden.to(device), self.tts.to(device), move(self.image_grid_thw),
            move(self.audio_feature_lengths),
        )  # fmt: skip


def talker_inputs(
    model: Any, config: Any, handoff: Handoff, speaker_id: int, thinker_eos: int
) -> dict[str, Any]:
    """The keyword arguments of ``talker.generate`` (besides sampling) for ``handoff``."""
    talker_cfg = config.talker_config
    dtype, device = model.dtype, handoff.embed.device
    input_ids = handoff.prompt_ids[None]
    sequences = torch.cat((handoff.prompt_ids, handoff.answer_ids))[None]
    thinker_embed = handoff.embed[None].to(dtype)
    thinker_hidden = handoff.hidden[None].to(dtype)
    mm_ids = (config.thinker_config.audio_token_id, config.thinker_config.image_token_id,
              config.thinker_config.video_token_id)  # fmt: skip
    multimodal_mask = torch.isin(sequences, torch.tensor(mm_ids, device=device))
    sequence_length = input_ids.shape[1]
    positions = torch.arange(sequence_length, device=device)[None]
    im_start = torch.where(input_ids == config.im_start_token_id, positions, -1)
    previous_im_start = torch.cummax(im_start, dim=-1).values.clamp_min(0)
    roles = input_ids.gather(1, (previous_im_start + 1).clamp_max(sequence_length - 1))
    user_mask = roles == config.user_token_id
    user_length = int(user_mask.sum())
    user_indices = torch.where(user_mask, sequence_length + positions, positions).argsort(dim=-1)
    user_indices = user_indices[:, -user_length:]

    # The user part: projected hidden states where media was, projected embeddings elsewhere.
    size = talker_cfg.text_config.hidden_size
    user_part = torch.empty((1, sequence_length, size), dtype=dtype, device=device)
    mm = multimodal_mask[:, :sequence_length]
    if mm.any():
        user_part[mm] = model.hidden_projection(thinker_hidden[:, :sequence_length][mm])
    user_part[~mm] = model.text_projection(thinker_embed[:, :sequence_length][~mm])
    user_embeds = user_part.gather(
        1, user_indices.unsqueeze(-1).expand(-1, -1, user_part.shape[-1])
    )
    user_ids = sequences[:, :sequence_length].gather(1, user_indices)

    starts = (input_ids[:, :-1] == config.im_start_token_id) & (
        input_ids[:, 1:] == config.assistant_token_id
    )
    assistant_start = int(torch.nonzero(starts[0]).flatten()[-1])
    tts_bos, tts_eos, tts_pad = model.text_projection(handoff.tts[None].to(dtype)).chunk(3, dim=1)

    assistant_hidden = model.text_projection(
        thinker_embed[:, assistant_start : sequences.shape[-1]]
    )
    text_part = torch.cat(
        (assistant_hidden[:, :3], tts_pad.expand(1, 4, -1), tts_bos, assistant_hidden[:, 3:4]),
        dim=1,
    )
    codec_ids = torch.tensor([[talker_cfg.codec_nothink_id, talker_cfg.codec_think_bos_id,
                               talker_cfg.codec_think_eos_id, speaker_id, talker_cfg.codec_pad_id,
                               talker_cfg.codec_bos_id]], device=device)  # fmt: skip
    codec_part = torch.cat(
        (torch.zeros((1, 3, size), dtype=dtype, device=device),
         model.get_input_embeddings()(codec_ids)),
        dim=1,
    )  # fmt: skip
    trailing = torch.cat((assistant_hidden[:, 4:], tts_eos), dim=1)
    # The end marker goes right after the answer's first end token, padding after it.
    is_eos = handoff.answer_ids == thinker_eos
    generated = len(handoff.answer_ids)
    steps = torch.arange(generated, device=device)
    first_eos = int(torch.where(is_eos, steps, generated).min()) if generated else 0
    slots = torch.arange(trailing.shape[1], device=device)[None, :, None]
    trailing = torch.where(slots > first_eos, tts_pad.to(trailing.dtype), trailing)
    trailing = torch.where(slots == first_eos, tts_eos.to(trailing.dtype), trailing)

    assistant_embeds = text_part + codec_part
    assistant_ids = torch.full(
        (1, text_part.shape[1]), config.tts_pad_token_id, dtype=torch.long, device=device
    )
    kwargs: dict[str, Any] = {
        "inputs_embeds": torch.cat((user_embeds, assistant_embeds), dim=1),
        "trailing_text_hidden": trailing,
        "tts_pad_embed": tts_pad,
        "talker_input_ids": torch.cat((user_ids, assistant_ids), dim=1),
        "attention_mask": torch.ones(
            (1, user_length + text_part.shape[1]), dtype=torch.long, device=device
        ),
    }
    if handoff.image_grid_thw is not None:
        kwargs["image_grid_thw"] = handoff.image_grid_thw
    if handoff.audio_feature_lengths is not None:
        kwargs["audio_feature_lengths"] = handoff.audio_feature_lengths
    return kwargs
