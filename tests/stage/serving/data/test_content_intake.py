"""Content parts on their way in, without a network: media cut into chunks and put
back byte for byte (and PCM as the same samples), a chat's windows joined into
turns, and a file's media type told by its bytes before its suffix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator.client import content
from services.engines.base import ChatTurn, MediaPart
from services.mesh.data import media_wire
from services.mesh.data.chunks import ChunkAssembler
from services.mesh.data.node import mesh_id
from services.mesh.errors import InvalidArgument
from services.mesh.media_types import of_file
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.tensors.transport import TensorReceiver
from services.stage.serving.content import Intake
from services.stage.serving.inputs import decode, input_bytes, merge

RECEIVER = TensorReceiver(mesh_id(), allow_refs=False)
IMAGE = bytes(range(256)) * 40  # 10 KiB
SAMPLES = torch.linspace(-1, 1, 3000)  # 12,000 bytes of float32


def chat(*parts: str | stage_pb2.ContentPart) -> stage_pb2.StageInputs:
    return stage_pb2.StageInputs(messages=[content.chat_message("user", *parts)])


def test_media_are_cut_into_chunks_and_put_back_as_they_were() -> None:
    inputs = chat("see", content.image(IMAGE, "image/png"), content.pcm(SAMPLES.tolist(), 8000))
    sent = media_wire.split(inputs, threshold=4096)
    assert len(sent) == 3 + 3  # 10 KiB and 12,000 bytes in 4 KiB pieces
    assert inputs.ByteSize() < 1024  # the message itself holds refs only
    chunks = ChunkAssembler(1 << 20)
    for chunk in sent:
        chunks.add(chunk)
    got = decode(inputs, RECEIVER, chunks, request_id="r")
    (turn,) = got.turns
    assert turn.parts[0] == "see" and turn.content == "see"
    image, audio = turn.media
    assert (image.kind, image.media_type, image.data) == ("image", "image/png", IMAGE)
    assert audio.pcm is not None and torch.equal(audio.pcm, SAMPLES)
    assert (audio.media_type, audio.sample_rate) == ("audio/pcm", 8000)
    assert input_bytes(got) >= len(IMAGE) + SAMPLES.nbytes  # media count as input
    assert chunks.pending_bytes == 0


def test_chunks_that_never_came_are_refused_naming_the_part() -> None:
    inputs = chat(content.image(IMAGE, "image/png"))
    media_wire.split(inputs, threshold=4096)  # cut, but the chunks are not delivered
    with pytest.raises(InvalidArgument) as refused:
        decode(inputs, RECEIVER, ChunkAssembler(1 << 20), request_id="r")
    assert refused.value.field == "inputs.messages[0].parts[0].image"


def test_the_kind_check_comes_before_any_decoding() -> None:
    inputs = chat(content.media_part("video", b"", ""))  # bad, but refused for its kind first
    with pytest.raises(InvalidArgument) as refused:
        decode(inputs, RECEIVER, request_id="r", intake=Intake("s", frozenset({"text"})))
    assert refused.value.message.endswith("stage s takes text, not video")


def test_windows_of_a_chat_with_media_join_into_turns() -> None:
    first = decode(chat("a", "b"), RECEIVER, request_id="r")
    second = decode(chat(content.audio(b"RIFF", "audio/wav")), RECEIVER, request_id="r")
    assert first.turns == () and first.messages == (("user", "a\nb"),)
    whole = merge([first, second])
    assert whole.messages == (("user", "a\nb"), ("user", ""))
    assert whole.turns == (
        ChatTurn("user", "a\nb"),  # no media: its text alone, as ChatTurn says
        ChatTurn("user", "", (MediaPart("audio", "audio/wav", b"RIFF"),)),
    )


@pytest.mark.parametrize(
    ("name", "head", "expected"),
    [
        ("x.bin", b"\x89PNG\r\n\x1a\n....", "image/png"),
        ("photo.png", b"\xff\xd8\xff\xe0", "image/jpeg"),  # the bytes win over the suffix
        ("clip", b"RIFF\x00\x00\x00\x00WAVEfmt ", "audio/wav"),
        ("song.mp3", b"\x00\x00garbage", "audio/mpeg"),  # no magic: the suffix
        ("notes.txt", b"hello", None),
    ],
)
def test_a_files_media_type(name: str, head: bytes, expected: str | None) -> None:
    assert of_file(Path(name), head) == expected
