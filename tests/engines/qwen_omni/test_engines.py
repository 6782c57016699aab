"""The three Qwen3-Omni engines, each loading only its part, against the
monolithic ``generate(return_audio=True)`` on the tiny random checkpoint:
answer ids, talker codes and waveform bit-equal, for text, image and audio
prompts (engine level: the request as a stage builds it, no wire)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from services.engines.qwen_omni import QwenOmniCode2Wav, QwenOmniTalker, QwenOmniThinker
from tests.engines.qwen_omni import parts
from tests.engines.qwen_omni.reference import request


@pytest.fixture(scope="module")
def engines(tiny_omni: Path) -> tuple[QwenOmniThinker, QwenOmniTalker, QwenOmniCode2Wav]:
    return parts.thinker(tiny_omni), parts.talker(tiny_omni), parts.code2wav(tiny_omni)


@pytest.mark.parametrize("index, part", [(0, "thinker"), (1, "talker"), (2, "code2wav")])
def test_each_part_holds_only_its_own_weights(engines, tiny_omni: Path, index, part) -> None:
    """A part holds exactly the numbers the checkpoint stores under its prefix
    (counted, and summed in float64 so random or missing weights would show;
    names differ: transformers renames experts and prefixes on load), so it
    holds nothing of the other parts."""
    from safetensors import safe_open

    model = engines[index]._model
    held = model.state_dict()
    prefix = part + "."
    with safe_open(str(tiny_omni / "model.safetensors"), "pt") as f:
        mine = {k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    assert sum(t.numel() for t in held.values()) == sum(t.numel() for t in mine.values())

    def energy(tensors) -> float:
        return sum(float(t.double().square().sum()) for t in tensors)

    assert energy(held.values()) == pytest.approx(energy(mine.values()), rel=1e-12)


@pytest.mark.parametrize("kind", ["text", "image", "audio"])
async def test_the_parts_in_a_row_equal_the_monolithic_model(engines, reference, kind) -> None:
    thinker, talker, code2wav = engines
    want = reference(kind)
    thought = await parts.think(thinker, request(kind))
    assert len(want.answer_ids) > 1 and len(want.codes) > 4 and want.audio.abs().max() > 0.05
    assert thought.answer_ids == want.answer_ids
    codes = await parts.talk(talker, thought)
    assert torch.equal(codes, want.codes)
    audio = torch.cat(await parts.vocode(code2wav, [codes]))
    assert torch.equal(audio, want.audio)


@pytest.mark.parametrize("sizes", [(1, 3, 8, 5), (8, 8), (40,), (2,) * 10])
async def test_code_windows_decode_as_chunked_decode(tiny_omni: Path, reference, sizes) -> None:
    """However the codes arrive, the audio is chunked_decode's with the same chunk
    and left context, one segment per chunk (the last one when the input ends)."""
    codes = reference("text").codes
    bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    windows = [codes[a:b] for a, b in itertools.pairwise(bounds) if a < len(codes)]
    windows.append(codes[bounds[-1] :])
    engine = parts.code2wav(tiny_omni, chunk_size=8, left=5)
    pieces = await parts.vocode(engine, [w for w in windows if len(w)])
    with torch.no_grad():
        want = engine._model.chunked_decode(codes.T[None], 8, 5).reshape(-1)
    assert len(pieces) == -(-len(codes) // 8)
    assert torch.equal(torch.cat(pieces), want)


async def test_bad_codes_are_refused_by_name(tiny_omni: Path) -> None:
    from services.engines.base import EngineRequest
    from services.mesh.errors import InvalidArgument

    engine = parts.code2wav(tiny_omni)
    for bad in (torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, 4), torch.full((2, 4), 32)):
        with pytest.raises(InvalidArgument, match=r"inputs\.tensors\.codes"):
            engine.check(EngineRequest("bad", tensors={"codes": bad}))


async def test_closing_the_thinker_drops_its_request_at_the_next_step(engines, reference) -> None:
    import time

    from services.engines.base import TokenOutput

    thinker = engines[0]
    stream = thinker.generate(thinker.check(request("text", "long", max_tokens=20000)))
    first = await anext(stream)
    while not isinstance(first, TokenOutput):  # the talker's prompt part comes first
        first = await anext(stream)
    began = time.perf_counter()
    await stream.aclose()  # 20,000 tokens would take minutes; the thread stops now
    assert time.perf_counter() - began < 10
    thought = await parts.think(thinker, request("text"))  # and the engine serves on
    assert thought.answer_ids == reference("text").answer_ids
