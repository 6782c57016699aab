from __future__ import annotations

import pytest
import torch

from services.mesh.errors import InvalidArgument
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.tensors import codec


@pytest.mark.parametrize("name", sorted(codec.DTYPES))
def test_every_dtype_round_trips(name: str) -> None:
    dtype = codec.DTYPES[name]
    source = torch.arange(24).reshape(2, 3, 4)
    tensor = (source % 2 == 0) if dtype == torch.bool else source.to(dtype)
    back = codec.from_proto(codec.to_proto(tensor, "t"))
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back.view(torch.uint8), tensor.contiguous().view(torch.uint8))


def test_non_contiguous_zero_dim_and_empty_tensors_round_trip() -> None:
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t()
    assert not t.is_contiguous()
    assert torch.equal(codec.from_proto(codec.to_proto(t)), t)
    scalar = torch.tensor(3.5)
    assert codec.from_proto(codec.to_proto(scalar)).item() == 3.5
    empty = torch.empty(0, 7, dtype=torch.float16)
    back = codec.from_proto(codec.to_proto(empty))
    assert back.shape == (0, 7) and back.dtype == torch.float16


def test_decoded_tensor_owns_writable_memory() -> None:
    msg = codec.to_proto(torch.zeros(4))
    back = codec.from_proto(msg)
    back += 1  # must not touch the message's bytes
    assert codec.from_proto(msg).sum().item() == 0


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (tensor_pb2.Tensor(dtype="float32", shape=[2, 3], raw=b"\0" * 20), "t.raw"),
        (tensor_pb2.Tensor(dtype="pickle", shape=[1], raw=b"\0"), "t.dtype"),
        (tensor_pb2.Tensor(dtype="float32", shape=[-1], raw=b""), "t.shape"),
        (tensor_pb2.Tensor(dtype="float32", shape=[1], shm=tensor_pb2.ShmRef(name="x")), "t"),
    ],
)
def test_disagreements_are_refused_naming_the_field(msg: tensor_pb2.Tensor, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        codec.from_proto(msg, "t")
    assert err.value.field == field
    assert err.value.message.startswith(field)
