"""What a catalogue case is, the builders of hostile inputs, and the adapters
that send them to a real server (see senders.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.mesh.data.shm_names import SECRET_HEX
from services.mesh.pb.omni.v1 import orchestrator_pb2, stage_pb2, tensor_pb2
from tests.hostile.conftest import Mesh
from tests.hostile.senders import (
    Outcome,
    Running,
    at_orchestrator,
    on_orchestrator_stream,
    on_stage,
    raw_frames,
)

Send = Callable[[Mesh], Awaitable[Outcome]]


@dataclass(frozen=True)
class Case:
    name: str
    send: Send
    code: str  # the status the hostile request (or RPC) must get
    field: str  # must be in the outcome's field (in-band) or details (RPC status)


# --- building inputs --------------------------------------------------------------


def submit(
    rid: str = "h",
    *,
    prompt: str | None = "Hello",
    seq: int = 0,
    last: bool = True,
    tensors: Sequence[tensor_pb2.Tensor] = (),
    token_ids: Sequence[int] = (),
    role: str = "user",
    transform: str = "",
    **params: Any,
) -> stage_pb2.StageInput:
    message = stage_pb2.Submit(request_id=rid, sequence=seq, is_last=last, transform=transform)
    if prompt is not None and not tensors and not token_ids:
        message.inputs.messages.add(role=role, content=prompt)
    message.inputs.token_ids.extend(token_ids)
    message.inputs.tensors.extend(tensors)
    for key, value in {"max_tokens": 4, "temperature": 0.0, **params}.items():
        if isinstance(value, list):
            getattr(message.params, key).extend(value)
        else:
            setattr(message.params, key, value)
    return stage_pb2.StageInput(submit=message)


def embeds(shape: Sequence[int], raw: bytes | None = None, **kw: Any) -> tensor_pb2.Tensor:
    """A prompt_embeds tensor ([seq, 64] float32 is what the tiny model takes)."""
    tensor = tensor_pb2.Tensor(name="prompt_embeds", dtype=kw.pop("dtype", "float32"), shape=shape)
    if raw is not None:
        tensor.raw = raw
    for key, value in kw.items():
        getattr(tensor, key).CopyFrom(value)
    return tensor


def chunk(chunk_id: str, offset: int, data: bytes, total: int) -> stage_pb2.StageInput:
    return stage_pb2.StageInput(
        chunk=tensor_pb2.TensorChunk(chunk_id=chunk_id, offset=offset, data=data, total=total)
    )


def chunked(chunk_id: str, rows: int) -> tensor_pb2.Tensor:
    return embeds([rows, 64], chunked=tensor_pb2.ChunkRef(chunk_id=chunk_id, nbytes=rows * 256))


def cancel(rid: str) -> stage_pb2.StageInput:
    return stage_pb2.StageInput(cancel=stage_pb2.Cancel(request_id=rid))


def streamed(message: stage_pb2.StageInput | Running) -> orchestrator_pb2.StreamInput | Running:
    """The same message on the orchestrator's GenerateStream (field numbers agree)."""
    if isinstance(message, Running):
        return message
    return orchestrator_pb2.StreamInput.FromString(message.SerializeToString())


def victim(mesh: Mesh, **ref: Any) -> tensor_pb2.Tensor:
    """Request "victim"'s shared block, as prompt_embeds, its ref changed by ``ref``."""
    tensor = tensor_pb2.Tensor()
    tensor.CopyFrom(mesh.victim)
    tensor.name = "prompt_embeds"
    for key, value in ref.items():
        setattr(tensor.shm, key, value)
    return tensor


# The request the victim's block was made for: a ref opens only in a request of
# that id (the ended request's id may be used again).
VICTIM = "victim"


def guessed(mesh: Mesh) -> str:
    """The victim's block name with the secret guessed: the rest of it is public."""
    return mesh.victim.shm.name[:-SECRET_HEX] + "0" * SECRET_HEX


def absent(mesh: Mesh) -> str:
    """A well-formed name of a block of the victim's request that was never made."""
    return mesh.victim.shm.name[:-SECRET_HEX] + "ab" * (SECRET_HEX // 2)


def foreign(tensor: tensor_pb2.Tensor) -> tensor_pb2.Tensor:
    """``tensor`` with its ref claiming a producer on another machine."""
    tensor.shm.producer.boot_id = "another-machine"
    tensor.shm.producer.ipc_namespace = "ipc:[1]"
    return tensor


def with_extra(message: stage_pb2.StageInput, **extra: Any) -> stage_pb2.StageInput:
    message.submit.params.extra.update(extra)
    return message


def with_trace(message: stage_pb2.StageInput, **context: str) -> stage_pb2.StageInput:
    message.submit.trace_context.update(context)
    return message


# --- how each is sent -------------------------------------------------------------


def stage(
    build: Callable[[Mesh], Sequence[stage_pb2.StageInput | Running]]
    | Sequence[stage_pb2.StageInput | Running],
    rid: str = "h",
    who: str | None = "mesh",
) -> Send:
    def send(mesh: Mesh) -> Awaitable[Outcome]:
        messages = build(mesh) if callable(build) else build
        return on_stage(mesh, messages, rid, who=who)

    return send


def stream(messages: Sequence[stage_pb2.StageInput | Running], rid: str = "h") -> Send:
    return lambda mesh: on_orchestrator_stream(mesh, [streamed(m) for m in messages], rid)


def orchestrator(
    build: Callable[[Mesh], orchestrator_pb2.GenerateRequest] | stage_pb2.StageInput,
    **stage_params: stage_pb2.GenerationParams,
) -> Send:
    def send(mesh: Mesh) -> Awaitable[Outcome]:
        if callable(build):
            request = build(mesh)
        else:
            s = build.submit
            request = orchestrator_pb2.GenerateRequest(
                request_id=s.request_id, inputs=s.inputs, params=s.params
            )
            for name, params in stage_params.items():
                request.stage_params[name].CopyFrom(params)
        return at_orchestrator(mesh, request)

    return send


def frames(method: str, *frames_: bytes) -> Send:
    return lambda mesh: raw_frames(mesh, method, frames_)


def orchestrator_request(
    mesh: Mesh, *tensors: tensor_pb2.Tensor
) -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(request_id="h")
    request.inputs.tensors.extend(tensors)
    return request
