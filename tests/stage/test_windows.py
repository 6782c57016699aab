from __future__ import annotations

import pytest
import torch

from services.mesh import tensors as codec
from services.mesh.errors import InvalidArgument
from services.mesh.pb.omni.v1 import stage_pb2
from services.stage.windows import InputAssembler


def piece(seq: int, last: bool, text: str = "", rows: int = 0) -> stage_pb2.Submit:
    s = stage_pb2.Submit(request_id="r", sequence=seq, is_last=last)
    s.inputs.text = text
    if rows:
        s.inputs.tensors.append(codec.to_proto(torch.full((rows, 2), float(seq)), "h"))
    return s


def test_single_submit_passes_through() -> None:
    whole = InputAssembler().add(piece(0, True, "hi"), in_flight=False)
    assert whole is not None and whole.inputs.text == "hi"


def test_windows_join_in_order() -> None:
    asm = InputAssembler()
    assert asm.add(piece(0, False, "a", rows=1), in_flight=False) is None
    assert asm.add(piece(1, False, "b", rows=2), in_flight=False) is None
    assert asm.pending == 1
    whole = asm.add(piece(2, True, "c", rows=1), in_flight=False)
    assert whole is not None and whole.inputs.text == "abc" and asm.pending == 0
    joined = codec.from_proto(whole.inputs.tensors[0])
    assert joined[:, 0].tolist() == [0.0, 1.0, 1.0, 2.0]


def test_out_of_order_and_duplicates_are_refused_by_field() -> None:
    asm = InputAssembler()
    with pytest.raises(InvalidArgument) as gap:
        asm.add(piece(1, True), in_flight=False)
    assert gap.value.field == "submit.sequence"
    asm.add(piece(0, False), in_flight=False)
    with pytest.raises(InvalidArgument) as dup:
        asm.add(piece(0, False), in_flight=False)
    assert dup.value.field == "submit.request_id"
    with pytest.raises(InvalidArgument) as running:
        asm.add(piece(0, True), in_flight=True)
    assert "already in flight" in running.value.message


def test_windows_with_different_trailing_shapes_are_refused() -> None:
    asm = InputAssembler()
    asm.add(piece(0, False, rows=1), in_flight=False)
    bad = piece(1, True)
    bad.inputs.tensors.append(codec.to_proto(torch.zeros(1, 3), "h"))
    with pytest.raises(InvalidArgument, match="pieces disagree"):
        asm.add(bad, in_flight=False)
