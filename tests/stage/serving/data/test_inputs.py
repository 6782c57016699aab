"""The one join: pieces of a tensor, from any transport and any window, become
one tensor before a transform or an engine reads them."""

from __future__ import annotations

import pytest
import torch

from services.mesh.data.node import mesh_id
from services.mesh.errors import InvalidArgument
from services.mesh.pb.omni.v1 import stage_pb2, tensor_pb2
from services.mesh.tensors import codec
from services.mesh.tensors.shm import ShmProducer
from services.mesh.tensors.transport import TensorReceiver
from services.stage.serving.inputs import Inputs, InputWindows, decode, merge

MESH = mesh_id()
RECEIVER = TensorReceiver(MESH, allow_refs=True)


def rows(start: int, count: int, width: int = 4) -> torch.Tensor:
    return torch.arange(start, start + count, dtype=torch.float32).repeat(width, 1).T.contiguous()


def window(text: str = "", tensors: list[tensor_pb2.Tensor] | None = None) -> Inputs:
    inputs = stage_pb2.StageInputs(text=text)
    inputs.tensors.extend(tensors or [])
    return decode(inputs, RECEIVER, request_id="r")


def test_inline_pieces_of_one_name_are_joined_in_order() -> None:
    got = window(tensors=[codec.to_proto(rows(0, 2), "h"), codec.to_proto(rows(2, 3), "h")])
    assert got.tensors["h"][:, 0].tolist() == [0, 1, 2, 3, 4]


def test_shared_memory_pieces_are_joined_like_inline_ones() -> None:
    producer = ShmProducer(MESH, ttl_s=60)
    try:
        pieces = [
            producer.put(rows(0, 3), "r"),
            codec.to_proto(rows(3, 1)),
            producer.put(rows(4, 2), "r"),
        ]
        for piece in pieces:
            piece.name = "hidden_states"
        got = window(tensors=pieces)
        assert got.tensors["hidden_states"][:, 0].tolist() == [0, 1, 2, 3, 4, 5]
    finally:
        producer.close()


def test_windows_merge_in_order_whatever_their_transport() -> None:
    producer = ShmProducer(MESH, ttl_s=60)
    try:
        by_ref = producer.put(rows(1, 2), "r")
        by_ref.name = "h"
        windows = InputWindows("r")
        windows.add(window("a", [codec.to_proto(rows(0, 1), "h")]))
        windows.add(window("b", [by_ref]))
        windows.add(window("c", [codec.to_proto(rows(3, 1), "h")]))
        whole = windows.whole()
        assert whole.text == "abc" and whole.tensors["h"][:, 0].tolist() == [0, 1, 2, 3]
    finally:
        producer.close()


def test_out_of_order_windows_are_refused_by_field() -> None:
    windows = InputWindows("r")
    with pytest.raises(InvalidArgument) as gap:
        windows.expect(1)
    assert gap.value.field == "submit.sequence"
    windows.expect(0)
    windows.add(None)
    with pytest.raises(InvalidArgument) as again:
        windows.expect(0)
    assert again.value.field == "submit.request_id" and "already in flight" in again.value.message


def test_pieces_that_disagree_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="trailing dims"):
        merge(
            [
                window(tensors=[codec.to_proto(rows(0, 1), "h")]),
                window(tensors=[codec.to_proto(torch.zeros(1, 3), "h")]),
            ]
        )


def test_first_dims_that_overflow_int64_are_refused() -> None:
    huge = tensor_pb2.Tensor(name="h", dtype="float32", shape=[1 << 62, 0])
    with pytest.raises(InvalidArgument) as err:
        merge([window(tensors=[huge]), window(tensors=[huge]), window(tensors=[huge])])
    assert err.value.field == "inputs.tensors.h" and "int64" in err.value.message


def test_a_shape_torch_cannot_allocate_is_invalid_argument() -> None:
    bad = tensor_pb2.Tensor(name="h", dtype="float32", shape=[1 << 62, 4, 0])
    with pytest.raises(InvalidArgument) as err:
        window(tensors=[bad])
    assert err.value.field == "inputs.tensors[0].shape"
