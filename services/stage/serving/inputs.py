"""A request's input in domain form: decoded, and whole before anything reads it.

This is the one place where pieces of a tensor become one tensor. Pieces come
from every path the data plane has: several ``Tensor`` messages of one name in
one Submit (shared blocks or CUDA IPC views travel as ordered pieces; chunked
bytes are taken whole from the stream's chunk assembler) and the windows of a windowed edge
(Submits with sequence 0, 1, 2 … and ``is_last`` on the last). Each piece is
decoded by the data plane (inline, shm, CUDA IPC) and pieces of one name are
concatenated along their first dim, so transforms and engines only ever see
whole tensors.

Windows of one request are merged in order: text concatenated, chat messages
and token ids appended, tensors of one name joined as above. A chat's content
parts (images, audio, video) are read and checked in ``content.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from services.engines.base import ChatTurn
from services.mesh.data.chunks import ChunkAssembler
from services.mesh.errors import InvalidArgument, ResourceExhausted
from services.mesh.pb.omni.v1 import stage_pb2
from services.mesh.tensors.transport import TensorReceiver
from services.stage.serving.content import Intake, check_kinds, read_messages

_MAX_ROWS = (1 << 63) - 1  # a first dim must fit the int64 of a wire shape
# What one window costs beyond its payload (its Inputs, dicts, tensor objects):
# 2,000 empty windows are not free.
WINDOW_OVERHEAD = 1024
_ID_BYTES = 36  # a token id held in a tuple: a pointer and an int object


@dataclass(frozen=True)
class Inputs:
    """What a request (or one window of it) gives the stage, tensors decoded and whole."""

    text: str = ""
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)
    # The chat with its content parts, when any message has media (EngineRequest.turns).
    turns: tuple[ChatTurn, ...] = ()
    token_ids: tuple[int, ...] = ()
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.text or self.messages or self.token_ids or self.tensors)


def input_bytes(inputs: Inputs) -> int:
    """What ``inputs`` takes in memory, near enough to budget by (O(fields), no copy)."""
    size = WINDOW_OVERHEAD + sys.getsizeof(inputs.text) + _ID_BYTES * len(inputs.token_ids)
    size += sum(sys.getsizeof(role) + sys.getsizeof(text) for role, text in inputs.messages)
    size += sum(len(m.data) + (m.pcm.nbytes if m.pcm is not None else 0)
                for turn in inputs.turns for m in turn.media)  # fmt: skip
    return size + sum(tensor.nbytes for tensor in inputs.tensors.values())


def decode(
    inputs: stage_pb2.StageInputs,
    receiver: TensorReceiver,
    chunks: ChunkAssembler | None = None,
    *,
    request_id: str,
    intake: Intake | None = None,
) -> Inputs:
    """``inputs`` of request ``request_id`` decoded by whatever transport each tensor
    came (chunked ones from ``chunks``, where their stream assembled them; shared
    blocks only if made for this request), pieces of one name joined. With
    ``intake``, a content part of a kind its engine does not take is refused first."""
    if intake is not None:
        check_kinds(inputs.messages, intake)
    pieces: dict[str, list[torch.Tensor]] = {}
    for index, tensor in enumerate(inputs.tensors):
        where = f"inputs.tensors[{index}]"
        if not tensor.name:
            raise InvalidArgument(f"{where}.name: must not be empty", field=f"{where}.name")
        try:
            decoded = receiver.decode(tensor, where, chunks, request_id=request_id)
        except (RuntimeError, ValueError, OverflowError) as exc:
            # torch refuses shapes whose storage size overflows: the input's fault.
            raise InvalidArgument(
                f"{where}.shape: {list(tensor.shape)} cannot be decoded ({exc})",
                field=f"{where}.shape",
            ) from None
        pieces.setdefault(tensor.name, []).append(decoded)
    messages, turns = read_messages(inputs.messages, receiver, chunks, request_id=request_id)
    return Inputs(
        text=inputs.text,
        messages=messages,
        turns=turns,
        token_ids=tuple(inputs.token_ids),
        tensors={name: join(name, parts) for name, parts in pieces.items()},
    )


def merge(windows: Sequence[Inputs]) -> Inputs:
    """The windows of one request, in order, as one input."""
    if len(windows) == 1:
        return windows[0]
    pieces: dict[str, list[torch.Tensor]] = {}
    for window in windows:
        for name, tensor in window.tensors.items():
            pieces.setdefault(name, []).append(tensor)
    return Inputs(
        text="".join(w.text for w in windows),
        messages=tuple(m for w in windows for m in w.messages),
        turns=_turns(windows),
        token_ids=tuple(t for w in windows for t in w.token_ids),
        tensors={name: join(name, parts) for name, parts in pieces.items()},
    )


def _turns(windows: Sequence[Inputs]) -> tuple[ChatTurn, ...]:
    """Every window's chat as turns when any window has media, else none."""
    if not any(w.turns for w in windows):
        return ()
    return tuple(
        turn for w in windows for turn in (w.turns or tuple(ChatTurn(r, c) for r, c in w.messages))
    )


def join(name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Ordered pieces of one tensor as one tensor, along the first dim."""
    if len(parts) == 1:
        return parts[0]
    where = f"inputs.tensors.{name}"
    first = parts[0]
    if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] or not p.dim() for p in parts):
        shapes = ", ".join(f"{p.dtype} {list(p.shape)}" for p in parts)
        raise InvalidArgument(
            f"{where}: pieces of one tensor must share dtype and trailing dims and have a "
            f"first dim to join along ({shapes})",
            field=where,
        )
    rows = sum(p.shape[0] for p in parts)
    if rows > _MAX_ROWS:
        raise InvalidArgument(
            f"{where}: the pieces' first dims add up to {rows}, more than an int64 holds",
            field=where,
        )
    return torch.cat(list(parts))


class InputWindows:
    """The windows of one request that have come so far, until the last one."""

    def __init__(self, request_id: str, max_windows: int = 4096) -> None:
        self.request_id = request_id
        self.max_windows = max_windows
        self.next_sequence = 0
        self._windows: list[Inputs] = []

    def expect(self, sequence: int) -> None:
        """Refuse a window out of order (the caller ends the request on it)."""
        if sequence == self.next_sequence:
            return
        rid = self.request_id
        if sequence == 0:
            # On a stream an id names one request until its final event, as an
            # HTTP/2 stream id does: reusing it while in flight resets that request,
            # and this error is the one final event the id gets.
            raise InvalidArgument(
                f"submit.request_id: request {rid!r} ends here: a second Submit with "
                "sequence 0 reused its id while it was already in flight",
                field="submit.request_id",
            )
        raise InvalidArgument(
            f"submit.sequence: request {rid!r} expected {self.next_sequence}, got {sequence}",
            field="submit.sequence",
        )

    def check_room(self) -> None:
        """Refuse one more kept window past ``max_windows`` (runtime.max_input_windows)."""
        if len(self._windows) >= self.max_windows:
            raise ResourceExhausted(
                f"inputs: request {self.request_id!r} holds {len(self._windows)} windows "
                f"waiting for its last; at most {self.max_windows} are kept "
                "(runtime.max_input_windows)",
                field="inputs",
            )

    def add(self, window: Inputs | None) -> None:
        """Count the window, keeping it unless None (streaming input: it went to the engine)."""
        if window is not None:
            self.check_room()
            self._windows.append(window)
        self.next_sequence += 1

    def whole(self) -> Inputs:
        """Every window so far joined (call after the last one); the windows are let go."""
        windows, self._windows = self._windows, []
        return merge(windows) if windows else Inputs()
