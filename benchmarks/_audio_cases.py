"""The pipelines benchmarks/first_audio.py times: one function per case,
returning a ``Case``.

A case says which stages to start, the windowed edges, which stage feeds the
audio stage and what it fed it (the thinker's text for a speaker, the talker's
codes for code2wav), and the audio stage timed alone on that input, through its
Stage stream and in this process. The runner is the same for every case.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
import yaml
from hibari import Hibari

from benchmarks import _omni as omni
from orchestrator.client import Result
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.mesh.rpc.stage_client import StageClient
from services.mesh.tensors.codec import from_proto, to_proto
from services.testing.configs import SMOLLM2

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "pipelines"
PROMPT = omni.PROMPT  # the same story prompt for every case


@dataclass(frozen=True)
class Spoken:
    """Audio made, and the wall time it took."""

    audio_s: float
    wall_s: float

    @property
    def rate(self) -> float:
        return self.audio_s / self.wall_s


@dataclass(frozen=True)
class Case:
    """One pipeline ending in an audio stage: stage files by name, the windowed
    edges (the ``full`` arm sets every window to -1), the stage whose audio the
    client plays, the stage that feeds it and what it fed (``feed`` of the
    client's Result; ``describe`` says its size), and the audio stage timed
    alone on that input, through its Stage stream (given the stage addresses)
    and in this process (``local``: what runs there)."""

    name: str
    stages: dict[str, dict[str, Any]]
    edges: list[dict[str, Any]]
    audio_stage: str
    fed_by: str
    feed: Callable[[Result], Any]
    describe: Callable[[Any], str]
    prompt: str
    params: dict[str, Any]
    through_stream: Callable[[dict[str, str], Any], Awaitable[Spoken]]
    in_process: Callable[[Any], Spoken]
    local: str
    target: float  # first audio this many times sooner windowed
    # The audio stage alone through its stream against in process: a target (or
    # None where fixed per-request costs swamp a tiny model's decode).
    stream_target: float | None = 0.95
    # Seconds of playback per second of audio made: 1, but for a tiny model whose
    # vocoder makes fewer samples than the real one (gaps judged at real length).
    play_scale: float = 1.0


async def stream_alone(address: str, inputs: stage_pb2.StageInputs, rate: int) -> Spoken:
    """One request straight to the stage at ``address``: its audio and wall time."""
    submit = stage_pb2.Submit(request_id="alone", inputs=inputs)
    async with StageClient(address) as client:
        began, samples = time.perf_counter(), 0
        call = client.open_stream()
        await call.write(stage_pb2.StageInput(submit=submit))
        await call.done_writing()
        while (output := await call.read()) is not grpc.aio.EOF:
            kind = output.WhichOneof("kind")
            if kind == "error":
                raise RuntimeError(f"the stage refused its input: {output.error.message}")
            if kind == "segment":
                samples += sum(samples_of(t) for t in output.segment.tensors)
        return Spoken(samples / rate, time.perf_counter() - began)


def samples_of(tensor: tensor_pb2.Tensor) -> int:
    """Audio samples in an "audio" tensor (float32 mono [samples]), however it travelled."""
    return int(tensor.shape[0]) if tensor.name == "audio" and tensor.shape else 0


def smollm2_hibari(cache: str, tokens: int | None) -> Case:
    tokens = 160 if tokens is None else tokens
    thinker = yaml.safe_load((EXAMPLES / "stages" / "thinker.yaml").read_text())
    speaker = yaml.safe_load((EXAMPLES / "stages" / "speaker.yaml").read_text())
    assert thinker["model"] == speaker["model"] == SMOLLM2
    pipeline = yaml.safe_load((EXAMPLES / "speech.yaml").read_text())
    tts = Hibari(threads=speaker.get("engine_args", {}).get("threads", 1))
    seed = speaker["defaults"]["seed"]
    tts("Warm up.", seed=seed)  # its spelling-to-sound tables load now, as the stage's do

    def in_process(text: str) -> Spoken:
        began, samples = time.perf_counter(), 0
        for sentence in Hibari.split_sentences(text):  # as the stage speaks: one by one
            samples += len(tts(sentence, seed=seed))
        return Spoken(samples / tts.sample_rate, time.perf_counter() - began)

    async def through_stream(addresses: dict[str, str], text: str) -> Spoken:
        inputs = stage_pb2.StageInputs(text=text)
        return await stream_alone(addresses["speaker"], inputs, tts.sample_rate)

    return Case(
        name="smollm2_hibari",
        stages={
            "thinker": {**thinker, "cache_dir": cache},
            "speaker": {**speaker, "cache_dir": cache},
        },
        edges=pipeline["edges"],
        audio_stage="speaker",
        fed_by="thinker",
        feed=lambda result: result.stages["thinker"].text,
        describe=lambda text: (
            f"{len(text)} characters in {len(Hibari.split_sentences(text))} sentences"
        ),
        prompt=PROMPT,
        params={"max_tokens": tokens, "temperature": 0.0, "seed": 0},
        through_stream=through_stream,
        in_process=in_process,
        local="hibari",
        target=4.0,
    )


def tiny_omni(cache: str, tokens: int | None) -> Case:
    """examples/pipelines/qwen3-omni.yaml's stages on the tiny random Qwen3-Omni:
    the talker's codes into code2wav, window -1 against code2wav's chunk_size.
    On this prompt the tiny talker never reaches codec_eos (benchmarks/_omni.py),
    so every answer is exactly ``tokens`` codes (default 128: >= 100, a real
    answer's length), the same in both arms."""
    from services.engines.qwen_omni import tiny

    codes = omni.TALKER_TOKENS if tokens is None else tokens
    stages = omni.stage_configs(
        None, ["cpu"] * 3, tokens=omni.THINKER_TOKENS, talker_tokens=codes,
        chunk=omni.TINY_CHUNK, tiny=True, cache_dir=cache,
    )  # fmt: skip
    code2wav = omni.Code2Wav(tiny.ensure(Path(cache)), omni.TINY_CHUNK)
    # The tiny code2wav makes 8 samples a code, the real one 1920 (12.5 codes/s at
    # 24 kHz): the client plays each piece for as long as the real model's would.
    real_samples_per_code = omni.SAMPLE_RATE / omni.CODES_PER_S
    play_scale = real_samples_per_code / int(code2wav.model.total_upsample)

    def feed(result: Result) -> torch.Tensor:
        steps = result.stages["talker"].tensors.get("codes", [])
        return torch.cat([from_proto(t, "codes") for t in steps]) if steps else torch.empty(0)

    def in_process(fed: torch.Tensor) -> Spoken:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the stage runs
        try:
            began = time.perf_counter()
            samples = code2wav(fed).shape[0]
            return Spoken(samples / omni.SAMPLE_RATE, time.perf_counter() - began)
        finally:
            torch.set_num_threads(threads)

    async def through_stream(addresses: dict[str, str], fed: torch.Tensor) -> Spoken:
        inputs = stage_pb2.StageInputs(tensors=[to_proto(fed, "codes")])
        return await stream_alone(addresses["code2wav"], inputs, omni.SAMPLE_RATE)

    return Case(
        name="tiny_omni",
        stages=stages,
        edges=omni.edges(omni.TINY_CHUNK),
        audio_stage="code2wav",
        fed_by="talker",
        feed=feed,
        describe=lambda fed: f"{fed.shape[0]} codes",
        prompt=omni.PROMPT,
        params={},
        through_stream=through_stream,
        in_process=in_process,
        local="chunked_decode",
        target=3.0,
        # The tiny code2wav decodes all 127 codes in about as long as a request's
        # fixed cost through the stage (docs/benchmarks.md), so the ratio says
        # nothing about the stream.
        stream_target=None,
        play_scale=play_scale,
    )


CASES: dict[str, Callable[[str, int | None], Case]] = {
    "smollm2_hibari": smollm2_hibari,
    "tiny_omni": tiny_omni,
}
