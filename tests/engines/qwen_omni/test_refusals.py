"""Bad input to the Qwen3-Omni engines is refused with INVALID_ARGUMENT naming
the field, before anything runs: undecodable media, video, a hand-off that is
missing or does not fit its answer, an unknown speaker."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engines.base import (
    ChatTurn,
    EngineRequest,
    EngineSettings,
    MediaPart,
    SamplingParams,
)
from services.engines.qwen_omni import QwenOmniTalker, QwenOmniThinker
from services.engines.qwen_omni.loading import torch_dtype
from services.mesh.errors import InitFailed, InvalidArgument
from tests.engines.qwen_omni import parts
from tests.engines.qwen_omni.reference import request


@pytest.fixture(scope="module")
def thinker(tiny_omni: Path) -> QwenOmniThinker:
    return parts.thinker(tiny_omni)


@pytest.fixture(scope="module")
def talker(tiny_omni: Path) -> QwenOmniTalker:
    return parts.talker(tiny_omni)


def with_part(part: MediaPart) -> EngineRequest:
    return EngineRequest("bad", turns=(ChatTurn("user", "hi", (part, "hi")),))


@pytest.mark.parametrize(
    ("part", "field"),
    [
        (MediaPart("image", "image/png", b"not a png"), r"inputs\.messages\[0\]\.parts\[0\]\.data"),
        (MediaPart("audio", "audio/wav", b"RIFFxxxx"), r"inputs\.messages\[0\]\.parts\[0\]\.data"),
        (MediaPart("audio", "audio/pcm", pcm=torch.zeros(2, 2), sample_rate=16000), r"\.pcm"),
        (MediaPart("video", "video/mp4", b"..."), r"inputs\.messages\[0\]\.parts\[0\]"),
    ],
)
def test_media_it_cannot_read_is_refused_naming_the_part(thinker, part, field) -> None:
    with pytest.raises(InvalidArgument, match=field):
        thinker.check(with_part(part))


def test_pcm_at_another_rate_is_taken(thinker) -> None:
    pcm = torch.sin(torch.arange(24000) / 24000 * 2 * torch.pi * 220)
    plan = thinker.check(with_part(MediaPart("audio", "audio/pcm", pcm=pcm, sample_rate=24000)))
    assert plan.inputs["feature_attention_mask"].sum() == 100  # 1 s at 16 kHz: 100 frames


async def test_a_handoff_that_does_not_fit_is_refused(thinker, talker) -> None:
    thought = await parts.think(thinker, request("text"))
    hidden = thought.handoff["hidden_states"]
    cases = {
        "inputs.tensors.hidden_states": {**thought.handoff, "hidden_states": hidden[:-1]},
        "inputs.tensors.tts_embeds": {**thought.handoff, "tts_embeds": hidden[:2, 0]},
        "inputs.tensors.prompt_ids": {
            k: v for k, v in thought.handoff.items() if k != "prompt_ids"
        },
        "inputs.tensors.extra": {**thought.handoff, "extra": hidden},
    }
    for field, tensors in cases.items():
        bad = EngineRequest("bad", token_ids=tuple(thought.answer_ids), tensors=tensors)
        with pytest.raises(InvalidArgument, match=field.replace(".", r"\.")):
            talker.check(bad)
    unknown = EngineRequest(
        "bad", token_ids=tuple(thought.answer_ids), tensors=thought.handoff,
        params=SamplingParams(extra={"speaker": "nobody"}),
    )  # fmt: skip
    with pytest.raises(InvalidArgument, match=r"params\.extra\.speaker"):
        talker.check(unknown)


def test_the_stage_dtype_auto_and_a_bad_one_refused_by_name() -> None:
    """`dtype: auto` (or none) is float32 on a CPU, bfloat16 on a GPU; a name torch
    has but the engines do not take is refused naming `dtype`, not an AttributeError."""
    assert torch_dtype(EngineSettings()) is torch.float32
    assert torch_dtype(EngineSettings(dtype="auto")) is torch.float32
    assert torch_dtype(EngineSettings(device="cuda:0", dtype="auto")) is torch.bfloat16
    assert torch_dtype(EngineSettings(dtype="bfloat16")) is torch.bfloat16
    for bad in ("int8", "float64x"):
        with pytest.raises(InitFailed, match="dtype") as caught:
            torch_dtype(EngineSettings(dtype=bad))
        assert caught.value.field == "dtype"


def test_an_unknown_speaker_or_a_missing_folder_fails_the_load_by_name(
    tiny_omni: Path, tmp_path: Path
) -> None:
    talker = QwenOmniTalker(EngineSettings(engine_args={"speaker": "nobody"}))
    with pytest.raises(InitFailed, match="nobody") as caught:
        talker.load(tiny_omni)
    assert caught.value.field == "engine_args.speaker"
    with pytest.raises(InitFailed, match="checkpoint folder") as caught:
        QwenOmniTalker(EngineSettings()).load(tmp_path / "absent")
    assert caught.value.field == "model"
