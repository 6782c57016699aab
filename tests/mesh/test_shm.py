"""Shared-memory blocks: real /dev/shm files, real subprocesses, nothing mocked."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import pytest
import torch

from services.mesh.data.node import node_identity
from services.mesh.data.shm_dir import mesh_dir
from services.mesh.data.shm_names import BLOCK_NAME, request_tag
from services.mesh.errors import FailedPrecondition, InvalidArgument
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.tensors.shm import ShmProducer, open_tensor
from tests.helpers.shm_blocks import block_path, blocks_of

SECRET = "0123456789abcdef" * 2  # the form of a block name's secret, for hand-made names
PRODUCER = "fedcba9876543210"  # the form of a producer's token


def made_name(mesh: str, request_id: str = "r", producer: str = PRODUCER) -> str:
    """A well-formed name of request ``request_id``'s block that no producer made."""
    return f"omni-{mesh}-{producer}-{request_tag(request_id)}-{SECRET}"


SAMPLES = {
    "float32": torch.randn(3, 5),
    "bfloat16": torch.randn(4, 6).to(torch.bfloat16),
    "float16": torch.randn(7).half(),
    "int64": torch.arange(-5, 5),
    "uint8": torch.arange(256, dtype=torch.uint8).reshape(16, 16),
    "bool": torch.tensor([[True, False], [False, True]]),
    "complex64": torch.randn(3, dtype=torch.complex64),
    "non-contiguous bf16": torch.randn(6, 4).to(torch.bfloat16).t(),
    "strided slice": torch.arange(100.0)[::7],
    "empty": torch.empty(0, 7, dtype=torch.float16),
    "scalar": torch.tensor(2.5, dtype=torch.float64),
}


@pytest.mark.parametrize("key", SAMPLES)
def test_round_trip(key: str, producer: ShmProducer, mesh: str) -> None:
    tensor = SAMPLES[key]
    msg = producer.put(tensor, "req-1")
    ref = msg.shm
    match = BLOCK_NAME.fullmatch(ref.name)
    assert match and match["mesh"] == mesh and match["producer"] == producer.files.token
    assert match["request"] == request_tag("req-1")
    assert ref.offset == 0 and ref.nbytes == tensor.numel() * tensor.element_size()
    assert ref.producer == node_identity()
    assert block_path(mesh, ref.name).stat().st_size == ref.nbytes
    back = open_tensor(msg, mesh_id=mesh, request_id="req-1", field="t")
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_a_ref_into_the_middle_of_a_block(producer: ShmProducer, mesh: str) -> None:
    msg = producer.put(torch.arange(16, dtype=torch.int32), "r")
    half = tensor_pb2.Tensor(dtype="int32", shape=[2, 4])
    half.shm.CopyFrom(msg.shm)
    half.shm.offset, half.shm.nbytes = 32, 32
    got = open_tensor(half, mesh_id=mesh, request_id="r", field="t")
    assert got.tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]]


def test_open_maps_the_block_without_copying_and_writes_stay_private(
    producer: ShmProducer, mesh: str
) -> None:
    msg = producer.put(torch.zeros(1 << 20), "r")  # 4 MiB
    first = open_tensor(msg, mesh_id=mesh, request_id="r", field="t")
    second = open_tensor(msg, mesh_id=mesh, request_id="r", field="t")
    # The block changes under the consumer: a copy made at open would not see it.
    last_page = (1 << 22) - 4096
    with open(block_path(mesh, msg.shm.name), "r+b") as block:
        block.seek(last_page)
        block.write(torch.full((1024,), 7.0).numpy().tobytes())
    assert first[-1].item() == 7.0 and second[-1].item() == 7.0
    # MAP_PRIVATE: the consumer may scribble on its tensor; the block and any
    # other consumer keep the producer's bytes.
    first[:1024] = 3.0
    assert second[0].item() == 0.0
    assert open_tensor(msg, mesh_id=mesh, request_id="r", field="t")[0].item() == 0.0


def test_tensor_outlives_every_other_reference_and_the_block_name(
    producer: ShmProducer, mesh: str
) -> None:
    source = torch.randn(1000)
    expected = source.clone()
    msg = producer.put(source, "r")
    fds_before = len(os.listdir("/proc/self/fd"))
    kept = [open_tensor(msg, mesh_id=mesh, request_id="r", field="t") for _ in range(20)]
    # The mapping holds no descriptor: a stage with thousands of live inputs
    # must not run out of files.
    assert len(os.listdir("/proc/self/fd")) == fds_before
    tensor = kept[7]
    del kept, source, msg
    assert producer.release("r") == 1
    assert blocks_of(mesh) == []
    gc.collect()
    assert torch.equal(tensor, expected)


def bad_ref(name: str, **fields: int) -> tensor_pb2.Tensor:
    ref = tensor_pb2.ShmRef(name=name, offset=0, nbytes=16, producer=node_identity())
    for key, value in fields.items():
        setattr(ref, key, value)
    return tensor_pb2.Tensor(dtype="float32", shape=[4], shm=ref)


@pytest.mark.parametrize(
    "name",
    ["../etc/passwd", "/etc/passwd", "a/b", "..", ".hidden", "", "omni-x-1-1\0", "passwd"],
)
def test_malformed_names_are_refused_before_the_file_system(name: str, mesh: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        open_tensor(
            bad_ref(name),
            mesh_id=mesh,
            request_id="r",
            field="inputs[2]",
            root=Path("/nonexistent"),
        )
    assert err.value.field == "inputs[2].shm.name"


def test_a_block_of_another_mesh_is_refused_before_the_file_system(mesh: str) -> None:
    with pytest.raises(FailedPrecondition) as err:
        open_tensor(
            bad_ref(made_name("other")),
            mesh_id=mesh,
            request_id="r",
            field="t",
            root=Path("/nonexistent"),
        )
    assert "not a block of this mesh" in err.value.message and err.value.field == "t.shm.name"
    # A mesh whose id extends ours is another mesh, not ours.
    with pytest.raises(FailedPrecondition):
        open_tensor(bad_ref(made_name(f"{mesh}-x")), mesh_id=mesh, request_id="r", field="t")


def test_a_block_of_another_request_is_refused_before_the_file_system(
    producer: ShmProducer, mesh: str
) -> None:
    msg = producer.put(torch.arange(4.0), "alice-1")
    # Copied into another request, the very same ref opens nothing.
    with pytest.raises(FailedPrecondition) as err:
        open_tensor(msg, mesh_id=mesh, request_id="mallory-1", field="inputs.tensors[0]")
    assert err.value.field == "inputs.tensors[0].shm.name"
    assert "not made for request 'mallory-1'" in err.value.message
    with pytest.raises(FailedPrecondition):  # nor does a free pooled block's name
        open_tensor(
            bad_ref(made_name(mesh).replace(request_tag("r"), "free")),
            mesh_id=mesh,
            request_id="r",
            field="t",
            root=Path("/nonexistent"),
        )
    got = open_tensor(msg, mesh_id=mesh, request_id="alice-1", field="inputs.tensors[0]")
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_missing_block_fails_its_precondition(producer: ShmProducer, mesh: str) -> None:
    for name in (made_name(mesh), made_name(mesh, producer=producer.files.token)):
        with pytest.raises(FailedPrecondition) as err:
            open_tensor(bad_ref(name), mesh_id=mesh, request_id="r", field="t")
        assert err.value.field == "t.shm.name" and "gone" in err.value.message
    # No mesh directory at all: no block either.
    with pytest.raises(FailedPrecondition) as err:
        open_tensor(bad_ref(made_name("t-none")), mesh_id="t-none", request_id="r", field="t")
    assert "gone" in err.value.message


def test_a_link_named_like_a_block_is_not_followed(
    producer: ShmProducer, mesh: str, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"\x01" * 16)
    link = block_path(mesh, made_name(mesh))
    link.symlink_to(secret)
    with pytest.raises(FailedPrecondition):
        open_tensor(bad_ref(link.name), mesh_id=mesh, request_id="r", field="t")


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"offset": 8}, "t.shm.offset"),  # 8 + 16 bytes past a 16-byte block
        ({"offset": 1 << 40}, "t.shm.offset"),
        ({"offset": 2, "nbytes": 16}, "t.shm.offset"),  # not float32-aligned
        ({"nbytes": 12}, "t.shm.nbytes"),  # float32[4] is 16 bytes
    ],
)
def test_refs_outside_or_disagreeing_with_the_block_are_refused(
    fields: dict[str, int], bad: str, producer: ShmProducer, mesh: str
) -> None:
    name = producer.put(torch.zeros(4), "r").shm.name
    with pytest.raises(InvalidArgument) as err:
        open_tensor(bad_ref(name, **fields), mesh_id=mesh, request_id="r", field="t")
    assert err.value.field == bad


def test_bad_dtype_and_foreign_producer_are_refused(producer: ShmProducer, mesh: str) -> None:
    msg = producer.put(torch.zeros(4), "r")
    msg.dtype = "pickle"
    with pytest.raises(InvalidArgument) as err:
        open_tensor(msg, mesh_id=mesh, request_id="r", field="t")
    assert err.value.field == "t.dtype"
    msg.dtype = "float32"
    msg.shm.producer.ipc_namespace = "ipc:[1]"
    with pytest.raises(FailedPrecondition, match="another node or IPC namespace"):
        open_tensor(msg, mesh_id=mesh, request_id="r", field="t")
    msg.shm.ClearField("producer")
    with pytest.raises(InvalidArgument, match="producer"):
        open_tensor(msg, mesh_id=mesh, request_id="r", field="t")


def test_release_by_owner_and_by_name_unlinks_the_files(producer: ShmProducer, mesh: str) -> None:
    a = [producer.put(torch.zeros(8), "req-a").shm.name for _ in range(3)]
    b = [producer.put(torch.zeros(8), "req-b").shm.name for _ in range(2)]
    assert blocks_of(mesh) == sorted(a + b) == sorted(producer.live_names)
    assert producer.release(names=[b[0], "omni-nope-1-1", "../x"]) == 1
    assert producer.release("req-a") == 3
    assert producer.release("req-a") == 0
    assert blocks_of(mesh) == [b[1]]
    producer.close()
    assert blocks_of(mesh) == [] and producer.live_names == []
    assert not mesh_dir(mesh).exists()  # the last producer out took the directory along


def test_blocks_expire_after_their_ttl(mesh: str) -> None:
    now = [100.0]
    with ShmProducer(mesh, ttl_s=30.0, clock=lambda: now[0]) as shm:
        old = shm.put(torch.zeros(8), "r1").shm.name
        now[0] = 120.0
        young = shm.put(torch.zeros(8), "r2").shm.name
        assert shm.expire() == 0
        now[0] = 130.0
        assert shm.expire() == 1
        assert blocks_of(mesh) == [young] and old not in shm.live_names


def test_producer_is_thread_safe(producer: ShmProducer, mesh: str) -> None:
    names: list[str] = []

    def work(owner: str) -> None:
        for i in range(25):
            names.append(producer.put(torch.full((16,), float(i)), owner).shm.name)
            if i % 5 == 4:
                producer.release(owner)

    threads = [threading.Thread(target=work, args=(f"req-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(names)) == 100
    assert blocks_of(mesh) == []


def test_a_block_name_cannot_be_guessed_from_the_rest_of_it(
    producer: ShmProducer, mesh: str
) -> None:
    first, second = (producer.put(torch.ones(4), "r") for _ in range(2))
    a, b = (BLOCK_NAME.fullmatch(m.shm.name) for m in (first, second))
    assert a and b and a["secret"] != b["secret"]
    # The right mesh, producer and request with another secret name no block.
    guess = tensor_pb2.Tensor()
    guess.CopyFrom(second)
    guess.shm.name = second.shm.name[: -len(SECRET)] + SECRET
    with pytest.raises(FailedPrecondition) as err:
        open_tensor(guess, mesh_id=mesh, request_id="r", field="t")
    assert "gone" in err.value.message
    assert open_tensor(second, mesh_id=mesh, request_id="r", field="t").sum().item() == 4
