"""Reassembles a request whose inputs arrive in several Submits (windowed edges).

Submits of one request carry sequence 0, 1, 2 … and the last has is_last. The
pieces are joined in order: text and token ids are concatenated, chat messages
appended, and tensors of the same name concatenated along their first dim.
"""

from __future__ import annotations

from services.mesh import tensors as codec
from services.mesh.errors import InvalidArgument
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2


class InputAssembler:
    def __init__(self) -> None:
        self._parts: dict[str, list[stage_pb2.Submit]] = {}

    @property
    def pending(self) -> int:
        return len(self._parts)

    def discard(self, request_id: str) -> bool:
        return self._parts.pop(request_id, None) is not None

    def add(self, submit: stage_pb2.Submit, *, in_flight: bool) -> stage_pb2.Submit | None:
        """The whole request once its last piece is in, else None."""
        rid = submit.request_id
        parts = self._parts.get(rid, [])
        if in_flight or (parts and submit.sequence == 0):
            raise InvalidArgument(
                f"submit.request_id: {rid!r} is already in flight", field="submit.request_id"
            )
        if submit.sequence != len(parts):
            self._parts.pop(rid, None)
            raise InvalidArgument(
                f"submit.sequence: request {rid!r} expected {len(parts)}, got {submit.sequence}",
                field="submit.sequence",
            )
        if not submit.is_last:
            self._parts.setdefault(rid, []).append(submit)
            return None
        if not parts:
            return submit
        del self._parts[rid]
        return _join([*parts, submit])


def _join(parts: list[stage_pb2.Submit]) -> stage_pb2.Submit:
    whole = stage_pb2.Submit(
        request_id=parts[0].request_id, is_last=True, transform=parts[0].transform
    )
    whole.params.CopyFrom(parts[0].params)
    inputs = whole.inputs
    inputs.text = "".join(p.inputs.text for p in parts)
    for part in parts:
        inputs.messages.extend(part.inputs.messages)
        inputs.token_ids.extend(part.inputs.token_ids)
    by_name: dict[str, list[tensor_pb2.Tensor]] = {}
    for part in parts:
        for tensor in part.inputs.tensors:
            by_name.setdefault(tensor.name, []).append(tensor)
    for name, pieces in by_name.items():
        inputs.tensors.append(codec.concat_raw(pieces, f"inputs.tensors.{name}"))
    return whole
