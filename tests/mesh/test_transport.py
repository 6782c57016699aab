from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
import torch

from services.mesh.data.chunks import split
from services.mesh.data.node import mesh_id, node_identity, same_ipc, same_node, shared_gpu
from services.mesh.errors import InvalidArgument
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.tensors import codec
from services.mesh.tensors.shm import ShmProducer
from services.mesh.tensors.transport import (
    TensorReceiver,
    TensorSender,
    TransportPolicy,
    choose,
    release_name,
)
from tests.helpers.shm_blocks import block_path, blocks_of, remove_mesh

BIG = 1 << 18  # float32 elements: 1 MiB, above the default inline limit
POLICY = TransportPolicy()


def identity(**changes: str | list[str]) -> tensor_pb2.NodeIdentity:
    """This process's identity with some fields changed (another node, namespace, ...)."""
    ident = tensor_pb2.NodeIdentity()
    ident.CopyFrom(node_identity())
    for key, value in changes.items():
        if isinstance(value, list):
            ident.ClearField(key)
            getattr(ident, key).extend(value)
        else:
            setattr(ident, key, value)
    return ident


def fake_cuda(index: int = 0) -> torch.Tensor:
    """A tensor that claims a GPU, so every CUDA choice is tested without one."""
    fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")
    with fake_tensor.FakeTensorMode():
        return torch.empty(BIG, device=f"cuda:{index}")


# --- node identity ---------------------------------------------------------------


def test_mesh_id_comes_from_the_environment_and_is_validated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMNI_MESH_ID", raising=False)
    assert mesh_id() == "default"
    monkeypatch.setenv("OMNI_MESH_ID", "prod-eu-1")
    assert mesh_id() == "prod-eu-1"
    for bad in ["", "-x", "Prod", "a/b", "a" * 32, "a_b", "../x"]:
        monkeypatch.setenv("OMNI_MESH_ID", bad)
        with pytest.raises(ValueError, match="OMNI_MESH_ID"):
            mesh_id()


def test_node_and_namespace_comparisons() -> None:
    here = node_identity()
    assert same_node(here, identity()) and same_ipc(here, identity())
    assert not same_node(here, identity(boot_id="other"))
    assert not same_node(here, identity(hostname="elsewhere"))
    assert not same_node(identity(boot_id=""), identity(boot_id=""))  # unknown is not equal
    assert same_node(identity(k8s_node_name="n1"), identity(k8s_node_name=""))
    assert not same_node(identity(k8s_node_name="n1"), identity(k8s_node_name="n2"))
    assert same_node(here, identity(ipc_namespace="ipc:[1]"))
    assert not same_ipc(here, identity(ipc_namespace="ipc:[1]"))
    gpus = identity(gpu_uuids=["GPU-a", "GPU-b"])
    assert shared_gpu(gpus, identity(gpu_uuids=["GPU-b"]), "GPU-b")
    assert not shared_gpu(gpus, identity(gpu_uuids=["GPU-b"]), "GPU-a")
    assert not shared_gpu(gpus, identity(boot_id="x", gpu_uuids=["GPU-b"]), "GPU-b")


# --- choice ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("consumer", "policy", "expected"),
    [
        (identity(), POLICY, ("shm", "same ipc namespace")),
        (None, POLICY, ("raw", "consumer unknown")),
        (identity(boot_id="other"), POLICY, ("raw", "other node")),
        (identity(hostname="other"), POLICY, ("raw", "other node")),
        (identity(k8s_node_name="other-node"), POLICY, ("shm", "same ipc namespace")),
        (identity(ipc_namespace="ipc:[1]"), POLICY, ("raw", "other ipc namespace")),
        (identity(), TransportPolicy(shm=False), ("raw", "shm disabled")),
    ],
    ids=["same-ipc", "unknown", "other-boot", "other-host", "k8s-one-side", "other-ipc", "off"],
)
def test_choice_for_cpu_tensors(
    consumer: tensor_pb2.NodeIdentity | None, policy: TransportPolicy, expected: tuple[str, str]
) -> None:
    assert choose(torch.zeros(BIG), node_identity(), consumer, policy) == expected


def test_small_tensors_always_go_inline() -> None:
    small = torch.zeros((64 << 10) // 4 - 1)
    assert choose(small, node_identity(), identity(), POLICY) == ("raw", "small")
    assert choose(torch.zeros((64 << 10) // 4), node_identity(), identity(), POLICY)[0] == "shm"


GPU_PRODUCER = {"gpu_uuids": ["GPU-aaa", "GPU-bbb"]}


@pytest.mark.parametrize(
    ("consumer", "policy", "expected"),
    [
        # cuda:1 is GPU-bbb here; the consumer numbers it 0 (CUDA_VISIBLE_DEVICES).
        (identity(gpu_uuids=["GPU-bbb"]), POLICY, ("cuda_ipc", "same gpu")),
        (identity(gpu_uuids=["GPU-aaa"]), POLICY, ("shm", "gpu not visible to consumer")),
        (identity(gpu_uuids=[]), POLICY, ("shm", "gpu not visible to consumer")),
        (
            identity(gpu_uuids=["GPU-bbb"], pid_namespace="pid:[9]"),
            POLICY,
            ("shm", "other pid namespace"),
        ),
        (
            identity(gpu_uuids=["GPU-bbb"]),
            TransportPolicy(cuda_ipc=False),
            ("shm", "cuda_ipc disabled"),
        ),
        (
            identity(gpu_uuids=["GPU-bbb"], ipc_namespace="ipc:[1]"),
            POLICY,
            ("raw", "other ipc namespace"),
        ),
        (identity(gpu_uuids=["GPU-bbb"], boot_id="other"), POLICY, ("raw", "other node")),
        (
            identity(gpu_uuids=["GPU-aaa"]),
            TransportPolicy(shm=False),
            ("raw", "shm disabled"),
        ),
    ],
    ids=["same-gpu", "other-gpu", "no-gpu", "other-pid", "off", "other-ipc", "other-node", "both"],
)
def test_choice_for_gpu_tensors(
    consumer: tensor_pb2.NodeIdentity, policy: TransportPolicy, expected: tuple[str, str]
) -> None:
    producer = identity(**GPU_PRODUCER)
    assert choose(fake_cuda(1), producer, consumer, policy) == expected


# --- sender and receiver ---------------------------------------------------------


@pytest.fixture
def mesh() -> Iterator[str]:
    mesh_id = f"t{uuid.uuid4().hex[:12]}"
    try:
        yield mesh_id
    finally:
        remove_mesh(mesh_id)


@pytest.fixture
def sender(mesh: str) -> Iterator[TensorSender]:
    with ShmProducer(mesh) as shm:
        yield TensorSender(mesh, POLICY, shm=shm, cuda=None)


def test_sender_picks_the_transport_and_receiver_opens_it(sender: TensorSender, mesh: str) -> None:
    receiver = TensorReceiver(mesh, allow_refs=True)
    big = torch.randn(BIG).to(torch.bfloat16)
    cases = [
        (torch.arange(10), identity(), "raw"),
        (big, identity(), "shm"),
        (big, identity(boot_id="other"), "raw"),
        (big, None, "raw"),
    ]
    for tensor, consumer, kind in cases:
        msg = sender.encode(tensor, "hidden", "req-1", consumer)
        assert msg.name == "hidden" and msg.WhichOneof("data") == kind
        assert torch.equal(receiver.decode(msg, "inputs[0]", request_id="req-1"), tensor)
    stats = sender.stats
    assert stats.tensors == {"raw": 3, "shm": 1}
    assert stats.bytes == {"raw": 80 + 2 * 2 * BIG, "shm": 2 * BIG}
    assert stats.fallbacks == {"other node": 1, "consumer unknown": 1}


def test_each_fallback_reason_is_logged_once_and_counted_always(
    sender: TensorSender, caplog: pytest.LogCaptureFixture
) -> None:
    far = identity(boot_id="other")
    with caplog.at_level(logging.INFO, logger="services.mesh.tensors.transport"):
        for i in range(3):
            sender.encode(torch.zeros(BIG), "x", f"req-{i}", far)
    lines = [r.getMessage() for r in caplog.records if "other node" in r.getMessage()]
    assert len(lines) == 1 and "req-0" in lines[0]
    assert sender.stats.fallbacks == {"other node": 3}


def shm_pool_names(sender: TensorSender) -> list[str]:
    pool = sender.shm.pool if sender.shm is not None else None
    return pool.free_names if pool is not None else []


def test_release_frees_the_blocks_of_a_request(sender: TensorSender, mesh: str) -> None:
    a = [sender.encode(torch.zeros(BIG), "x", "req-a", identity()) for _ in range(2)]
    b = sender.encode(torch.zeros(BIG), "x", "req-b", identity())
    assert sender.release(names=[release_name(a[0])]) == 1
    assert sender.release("req-a") == 1
    # Released blocks are gone under the names their consumers knew; the pool
    # keeps them for reuse under fresh names.
    assert not any(block_path(mesh, m.shm.name).exists() for m in a)
    assert set(blocks_of(mesh)) == {b.shm.name, *shm_pool_names(sender)}
    assert release_name(tensor_pb2.Tensor(raw=b"")) == ""


def test_receiver_refuses_refs_from_outside_and_unresolved_chunks(
    sender: TensorSender, mesh: str
) -> None:
    ref = sender.encode(torch.zeros(BIG), "x", "req", identity())
    with pytest.raises(InvalidArgument) as err:
        TensorReceiver(mesh, allow_refs=False).decode(
            ref, "submit.inputs.tensors[3]", request_id="req"
        )
    assert err.value.field == "submit.inputs.tensors[3]"
    assert "only accepted from inside the mesh" in err.value.message
    cuda = tensor_pb2.Tensor(dtype="float32", shape=[1], cuda_ipc=tensor_pb2.CudaIpcRef())
    with pytest.raises(InvalidArgument, match="inside the mesh"):
        TensorReceiver(mesh, allow_refs=False).decode(cuda, "t", request_id="req")
    chunked = [codec.to_proto(torch.zeros(2 * BIG))]
    split(chunked)
    with pytest.raises(InvalidArgument, match="not resolved") as err:
        TensorReceiver(mesh, allow_refs=True).decode(chunked[0], "t", request_id="req")
    assert err.value.field == "t"


def test_sender_without_producers_sends_inline(mesh: str) -> None:
    sender = TensorSender(mesh, POLICY, shm=None, cuda=None)
    assert sender.encode(torch.zeros(BIG), "x", "r", identity()).WhichOneof("data") == "raw"
    assert sender.stats.fallbacks == {"shm disabled": 1}
    with ShmProducer(mesh) as shm, pytest.raises(ValueError, match="mesh"):
        TensorSender("another", POLICY, shm=shm, cuda=None)
