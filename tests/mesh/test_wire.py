"""The torch-free wire helpers agree with torch, and read shm refs as a stage would."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import torch

from services.mesh.data.shm_refs import read_bytes
from services.mesh.data.wire import ITEMSIZE, concat_raw, nbytes_of
from services.mesh.errors import FailedPrecondition, InvalidArgument
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.tensors import codec
from services.mesh.tensors.shm import ShmProducer
from tests.helpers.shm_blocks import remove_mesh
from tests.mesh.test_shm import SAMPLES, bad_ref, made_name


@pytest.fixture
def producer(mesh: str) -> Iterator[ShmProducer]:
    with ShmProducer(mesh) as shm:
        yield shm


@pytest.fixture
def mesh() -> Iterator[str]:
    mesh_id = f"w{uuid.uuid4().hex[:12]}"
    yield mesh_id
    remove_mesh(mesh_id)


def test_dtype_sizes_are_torchs() -> None:
    assert set(ITEMSIZE) == set(codec.DTYPES)
    for name, dtype in codec.DTYPES.items():
        assert ITEMSIZE[name] == dtype.itemsize, name


@pytest.mark.parametrize("key", SAMPLES)
def test_read_bytes_gives_what_the_codec_would(key: str, producer: ShmProducer, mesh: str) -> None:
    tensor = SAMPLES[key]
    msg = producer.put(tensor, "r")
    inline = read_bytes(msg, mesh_id=mesh, request_id="r", field="t")
    assert inline.WhichOneof("data") in ("raw", None)
    assert torch.equal(codec.from_proto(inline, "t"), tensor.contiguous())
    assert inline == codec.to_proto(tensor) or inline.raw == codec.to_proto(tensor).raw


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"offset": 8}, "t.shm.offset"),
        ({"offset": 1 << 40}, "t.shm.offset"),
        ({"offset": 2, "nbytes": 16}, "t.shm.offset"),
        ({"nbytes": 12}, "t.shm.nbytes"),
    ],
)
def test_read_bytes_refuses_what_open_tensor_refuses(
    fields: dict[str, int], bad: str, producer: ShmProducer, mesh: str
) -> None:
    name = producer.put(torch.zeros(4), "r").shm.name
    with pytest.raises(InvalidArgument) as err:
        read_bytes(bad_ref(name, **fields), mesh_id=mesh, request_id="r", field="t")
    assert err.value.field == bad


def test_read_bytes_refuses_paths_and_other_meshes(producer: ShmProducer, mesh: str) -> None:
    msg = producer.put(torch.zeros(4), "r")
    msg.shm.name = "../etc/passwd"
    with pytest.raises(InvalidArgument, match="not a bare block name"):
        read_bytes(msg, mesh_id=mesh, request_id="r", field="t")
    msg.shm.name = made_name("other")
    with pytest.raises(FailedPrecondition, match="not a block of this mesh"):
        read_bytes(msg, mesh_id=mesh, request_id="r", field="t")


def test_read_bytes_refuses_another_requests_block(producer: ShmProducer, mesh: str) -> None:
    msg = producer.put(torch.arange(4.0), "alice-1")
    with pytest.raises(FailedPrecondition, match="not made for request 'bob-1'") as err:
        read_bytes(msg, mesh_id=mesh, request_id="bob-1", field="segment.tensors[0]")
    assert err.value.field == "segment.tensors[0].shm.name"
    read = read_bytes(msg, mesh_id=mesh, request_id="alice-1", field="t")
    assert read.raw == torch.arange(4.0).numpy().tobytes()


def test_shapes_beyond_any_tensor_are_refused_not_crashed() -> None:
    piece = tensor_pb2.Tensor(name="h", dtype="float32", shape=[1 << 62, 0], raw=b"")
    with pytest.raises(InvalidArgument, match="too large"):
        concat_raw([piece, piece, piece], "window.tensors.h")  # 3 * 2**62 overflows int64
    huge = tensor_pb2.Tensor(name="h", dtype="float64", shape=[1 << 40, 1 << 40])
    with pytest.raises(InvalidArgument) as err:
        nbytes_of(huge, "t")
    assert err.value.field == "t.shape"


def test_the_orchestrator_process_does_not_import_torch() -> None:
    code = (
        "import sys, orchestrator.cli.main, orchestrator.cli.commands, orchestrator.server.server, "
        "orchestrator.cli.launcher, orchestrator.client, orchestrator.cli.outputs; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
