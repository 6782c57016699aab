"""Reading the thinker's hand-off into the talker (config.py names the tensors): the
first window's prompt part and any answer rows, then each later window's answer
rows. Anything that does not fit is refused naming the tensor."""

from __future__ import annotations

import torch

from services.engines.base import EngineRequest
from services.engines.qwen_omni import config as names
from services.engines.qwen_omni.handoff import Handoff
from services.engines.request_checks import TOKEN_IDS, refuse, tensor_field

_SOURCE = "the thinker's hand-off (an edge from a qwen_omni_thinker with engine_args.handoff)"


def first_handoff(request: EngineRequest, size: int) -> Handoff:
    """The prompt's part, and the answer rows the first window brought."""
    tensors = request.tensors
    for name in (names.PROMPT_HIDDEN, names.PROMPT_IDS, names.TTS_EMBEDS):
        if name not in tensors:
            refuse(tensor_field(name), f"missing: {_SOURCE}")
    prompt = tensors[names.PROMPT_IDS].long().reshape(-1)
    hidden = tensors[names.PROMPT_HIDDEN]
    if tuple(hidden.shape) != (len(prompt), 2, size):
        why = "the prompt's rows; layer 0 and the accept layer"
        got = list(hidden.shape)
        refuse(
            tensor_field(names.PROMPT_HIDDEN),
            f"expected [{len(prompt)}, 2, {size}] ({why}), got {got}",
        )
    tts = tensors[names.TTS_EMBEDS]
    if tuple(tts.shape) != (3, size):
        refuse(tensor_field(names.TTS_EMBEDS), f"expected [3, {size}], got {list(tts.shape)}")
    grid, lengths = tensors.get(names.IMAGE_GRID), tensors.get(names.AUDIO_LENGTHS)
    handoff = Handoff(
        prompt_ids=prompt,
        prompt_hidden=hidden.float(),
        tts=tts.float(),
        image_grid_thw=grid.long() if grid is not None else None,
        audio_feature_lengths=lengths.long() if lengths is not None else None,
    )
    handoff.add(*answer_rows(request, size))
    return handoff


def answer_rows(request: EngineRequest, size: int) -> tuple[list[int], torch.Tensor]:
    """A window's answer tokens and their layer-0 rows [n, hidden]."""
    ids = list(request.token_ids)
    rows = request.tensors.get(names.HIDDEN)
    if rows is None:
        if ids:
            refuse(tensor_field(names.HIDDEN), f"missing: the answer's rows ({_SOURCE})")
        return [], torch.zeros(0, size)
    if tuple(rows.shape) != (len(ids), size):
        refuse(tensor_field(names.HIDDEN), f"expected [{len(ids)}, {size}] (a layer-0 row per "
               f"answer token in {TOKEN_IDS}), got {list(rows.shape)}")  # fmt: skip
    return ids, rows.float()
