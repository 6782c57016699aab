"""The talker's inputs from what the thinker handed over: the monolithic
``Qwen3OmniMoeForConditionalGeneration.generate``'s step 2 ("Prepare talker input")
for one request, reading the tensors of config.py instead of the thinker's generate
result, kept line for line with transformers 5.24.

Split in two for a streamed edge: ``talker_prompt`` needs only the prompt's part and
the answer's first token (what the talker's prefill reads), and ``trailing`` gives
the talker's decode step ``step`` its text row, needing only answer token
``step + 1``, or the answer's end: the monolithic model reads the same rows, so a
talker fed window by window computes what it computes fed all at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Handoff:
    """What the thinker has given one request so far."""

    prompt_ids: torch.Tensor  # [S] int64
    prompt_hidden: torch.Tensor  # [S, 2, H]: layer 0 and the talker's accept layer
    tts: torch.Tensor  # [3, H]: tts_bos, tts_eos, tts_pad, the thinker's embeddings
    image_grid_thw: torch.Tensor | None = None
    audio_feature_lengths: torch.Tensor | None = None
    answer_ids: list[int] = field(default_factory=list)
    answer_embeds: list[torch.Tensor] = field(default_factory=list)  # [H] each: layer 0
    ended: bool = False  # the answer is whole: len(answer_ids) is its length

    def add(self, ids: list[int], embeds: torch.Tensor) -> None:
        """More of the answer (from the event loop: the rows go in first, so the model
        thread never reads an id without its row)."""
        self.answer_embeds += list(embeds.to(self.prompt_hidden.device))
        self.answer_ids += ids

    def to(self, device: str) -> Handoff:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.to(device) if t is not None else None

        return Handoff(
            self.prompt_ids.to(device), self.prompt_hidden.to(device), self.tts.to(device),
            move(self.image_grid_thw), move(self.audio_feature_lengths), list(self.answer_ids),
            [e.to(device) for e in self.answer_embeds], self.ended,
        )  # fmt: skip

    @property
    def end_slot(self) -> int | None:
        """The decode step that reads tts_eos (the later ones read tts_pad); None
        while the answer goes on. The monolithic model's trailing text is answer
        tokens 1 .. A - 2 then tts_eos: the last token is never fed to the thinker."""
        return max(len(self.answer_ids) - 2, 0) if self.ended else None

    def has_row(self, step: int) -> bool:
        """Whether decode step ``step`` can be given its text row now: token step + 1's,
        unless the answer ends there, which only token step + 2's being there rules
        out (or the answer's end, once known)."""
        return self.ended or len(self.answer_embeds) >= step + 3


@dataclass(frozen=True)
class Prompt:
    inputs_embeds: torch.Tensor  # [1, P, Ht]
    talker_input_ids: torch.Tensor  # [1, P]
    tts_eos: torch.Tensor  # [1, 1, Ht], projected
    tts_pad: torch.Tensor  # [1, 1, Ht], projected
    grids: dict[str, torch.Tensor]  # image_grid_thw, audio_feature_lengths when media


def talker_prompt(model: Any, config: Any, handoff: Handoff, speaker_id: int) -> Prompt:
    """The talker's prompt: the user part and the assistant's start, through the
    answer's first token (``handoff`` holds at least that)."""
    talker_cfg = config.talker_config
    dtype, device = model.dtype, handoff.prompt_hidden.device
    input_ids = handoff.prompt_ids[None]
    first = torch.tensor(handoff.answer_ids[:1], device=device)
    sequences = torch.cat((handoff.prompt_ids, first))[None]
    thinker_embed = torch.cat((handoff.prompt_hidden[:, 0], handoff.answer_embeds[0][None]))
    thinker_embed = thinker_embed[None].to(dtype)
    thinker_hidden = handoff.prompt_hidden[None, :, 1].to(dtype)
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
    # <|im_start|>assistant\\n and the answer's first token.
    assistant_hidden = model.text_projection(thinker_embed[:, assistant_start:])
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
    assistant_embeds = text_part + codec_part
    assistant_ids = torch.full(
        (1, text_part.shape[1]), config.tts_pad_token_id, dtype=torch.long, device=device
    )
    grids: dict[str, torch.Tensor] = {}
    if handoff.image_grid_thw is not None:
        grids["image_grid_thw"] = handoff.image_grid_thw
    if handoff.audio_feature_lengths is not None:
        grids["audio_feature_lengths"] = handoff.audio_feature_lengths
    return Prompt(
        torch.cat((user_embeds, assistant_embeds), dim=1),
        torch.cat((user_ids, assistant_ids), dim=1),
        tts_eos,
        tts_pad,
        grids,
    )


def trailing(handoff: Handoff, prompt: Prompt, step: int) -> torch.Tensor | None:
    """Decode step ``step``'s text row [1, 1, Ht] past the answer: tts_eos at its end,
    tts_pad after it; None while the answer lasts (``handoff.has_row(step)``): then it
    is answer token ``step + 1``'s row, projected (``model.text_projection``)."""
    end = handoff.end_slot
    if end is not None and step > end:
        return prompt.tts_pad
    if end is not None and step == end:
        return prompt.tts_eos
    return None
