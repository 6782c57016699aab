"""Tensors pulled from a producer's data port (services/mesh/data/pull.py): a real
TCP server on 127.0.0.1, the mesh's sender and receiver at either end."""

from __future__ import annotations

import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from services.mesh.data.pull import MAGIC, STREAMS, STRIPE_BYTES, key_name, pull
from services.mesh.data.pull_server import PullServer
from services.mesh.data.ref_reader import RefReader
from services.mesh.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.mesh.pb.omni.v1 import tensor_pb2
from services.mesh.tensors import codec
from services.mesh.tensors.transport import (
    TensorReceiver,
    TensorSender,
    TransportPolicy,
    release_name,
)
from tests.mesh.test_transport import identity

MESH = "pulltest"
ELSEWHERE = identity(k8s_node_name="node-b", boot_id="another-boot")
BIG = 1 << 18  # float32 elements: 1 MiB, the default pull_min_bytes


@pytest.fixture
def server() -> Iterator[PullServer]:
    with PullServer(token="mesh-token-0123456789") as server:
        yield server


@pytest.fixture
def sender(server: PullServer) -> TensorSender:
    return TensorSender(
        MESH, TransportPolicy(), shm=None, cuda=None, chunk_bytes=1 << 20, pull=server
    )


def receiver(token: str | None = "mesh-token-0123456789") -> TensorReceiver:
    return TensorReceiver(MESH, allow_refs=True, token=token)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_a_tensor_for_another_node_is_pulled_whole_by_its_consumer(
    sender: TensorSender, server: PullServer, dtype: torch.dtype
) -> None:
    rows = (BIG * 4 // dtype.itemsize) // 64  # 1 MiB whatever the dtype
    source = (torch.randn(rows, 64) * 100).to(dtype)
    msg = sender.encode(source, "hidden", "req-1", ELSEWHERE)
    assert msg.WhichOneof("data") == "pull"
    assert msg.pull.address == server.address and msg.pull.producer.boot_id
    assert msg.pull.nbytes == source.numel() * source.element_size()
    # What crosses the orchestrator is the ref alone.
    assert msg.ByteSize() < 512
    got = receiver().decode(msg, "inputs.tensors[0]", request_id="req-1")
    assert got.dtype == dtype and torch.equal(got, source)
    assert sender.stats.tensors == {"pull": 1} and sender.stats.fallbacks == {"other node": 1}
    assert server.served == 1


def test_a_non_contiguous_tensor_arrives_as_its_values(sender: TensorSender) -> None:
    source = torch.randn(64, BIG // 64).t()  # a view: columns first
    msg = sender.encode(source, "t", "req-1", ELSEWHERE)
    got = receiver().decode(msg, "t", request_id="req-1")
    assert torch.equal(got, source)


def test_small_tensors_and_unknown_consumers_stay_on_the_stream(sender: TensorSender) -> None:
    small = torch.randn(1024)  # 4 KiB: under pull_min_bytes, over the inline limit
    assert sender.encode(small, "t", "r", ELSEWHERE).WhichOneof("data") == "raw"
    big = torch.randn(2 * BIG)  # a consumer the orchestrator did not name: bytes
    assert sender.encode(big, "t", "r", None).WhichOneof("data") == "chunked"


def test_pull_refuses_a_wrong_request_a_wrong_token_and_released_bytes(
    sender: TensorSender, server: PullServer
) -> None:
    msg = sender.encode(torch.randn(BIG), "t", "req-1", ELSEWHERE)
    with pytest.raises(FailedPrecondition, match=r"t\.pull: .*held for another request"):
        receiver().decode(msg, "t", request_id="req-2")
    with pytest.raises(FailedPrecondition, match="mesh token is missing or wrong"):
        receiver(token=None).decode(msg, "t", request_id="req-1")
    with pytest.raises(FailedPrecondition, match="mesh token is missing or wrong"):
        receiver(token="another-token-0123456").decode(msg, "t", request_id="req-1")
    assert server.served == 0
    assert sender.release("req-1") == 1 and server.held_bytes == 0
    with pytest.raises(FailedPrecondition, match=r"refused the pull: gone \(released"):
        receiver().decode(msg, "t", request_id="req-1")


def test_release_by_name_by_request_and_by_ttl(server: PullServer) -> None:
    sender = TensorSender(MESH, TransportPolicy(), shm=None, cuda=None, pull=server)
    a = sender.encode(torch.randn(BIG), "a", "req-a", ELSEWHERE)
    b = sender.encode(torch.randn(BIG), "b", "req-b", ELSEWHERE)
    sender.encode(torch.randn(BIG), "c", "req-c", ELSEWHERE)
    assert server.held_bytes == 3 * BIG * 4
    assert release_name(a) == key_name(a.pull.key) and release_name(a) in server.live_names()
    assert sender.release(None, [release_name(a)]) == 1
    assert sender.release("req-b") == 1 and release_name(b) not in server.live_names()
    assert server.expire(now=time.monotonic() + 301) == 1  # the default TTL: 300 s
    assert server.held_bytes == 0 and server.live_names() == []


def test_past_its_limit_the_producer_sends_bytes_instead() -> None:
    with PullServer(max_held_bytes=BIG * 4 + 8) as server:
        sender = TensorSender(
            MESH, TransportPolicy(), shm=None, cuda=None, chunk_bytes=1 << 20, pull=server
        )
        first = sender.encode(torch.randn(BIG), "t", "r", ELSEWHERE)
        second = sender.encode(torch.randn(BIG + 1), "t", "r", ELSEWHERE)
    assert first.WhichOneof("data") == "pull" and second.WhichOneof("data") == "chunked"


def test_a_ref_with_a_size_its_shape_does_not_have_is_refused_before_any_pull(
    sender: TensorSender, server: PullServer
) -> None:
    msg = sender.encode(torch.randn(BIG), "t", "r", ELSEWHERE)
    msg.pull.nbytes = 1 << 40  # a hostile ref asking the consumer for a terabyte
    with pytest.raises(InvalidArgument, match=r"t\.pull\.nbytes: 1099511627776"):
        receiver().decode(msg, "t", request_id="r")
    bad = tensor_pb2.Tensor(name="t", dtype="uint8", shape=[4])
    bad.pull.CopyFrom(tensor_pb2.PullRef(address="no-port", key=b"k", nbytes=4))
    with pytest.raises(InvalidArgument, match=r"t\.pull: expected address host:port"):
        receiver().decode(bad, "t", request_id="r")
    assert server.served == 0


def test_a_producer_that_is_gone_is_unavailable_naming_the_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when we leave: nobody listens there
    ref = tensor_pb2.PullRef(address=f"127.0.0.1:{port}", key=b"0" * 16, nbytes=4)
    with pytest.raises(Unavailable, match=rf"t\.pull: cannot pull from 127\.0\.0\.1:{port}"):
        pull(ref, field="t", request_id="r")


def test_refs_from_outside_the_mesh_are_refused_before_dialing() -> None:
    msg = tensor_pb2.Tensor(name="t", dtype="uint8", shape=[4])
    msg.pull.CopyFrom(tensor_pb2.PullRef(address="10.0.0.1:1", key=b"0" * 16, nbytes=4))
    outside = TensorReceiver(MESH, allow_refs=False)
    with pytest.raises(InvalidArgument, match="only accepted from inside the mesh"):
        outside.decode(msg, "inputs.tensors[0]", request_id="r")


def test_junk_and_silent_connections_do_not_stop_the_port(
    sender: TensorSender, server: PullServer
) -> None:
    host, port = server.address.rsplit(":", 1)
    silent = socket.create_connection((host, int(port)))  # says nothing, holds a slot
    with socket.create_connection((host, int(port))) as junk:
        junk.sendall(b"GET / HTTP/1.1\r\n\r\n")
        status, n = struct.unpack(">BQ", junk.recv(9))
        assert status == 1 and b"not an omni pull" in junk.recv(n)
    with socket.create_connection((host, int(port))) as liar:  # a field of 60 KiB
        liar.sendall(MAGIC + struct.pack(">H", 60000))
        status, n = struct.unpack(">BQ", liar.recv(9))
        assert status == 1 and b"a field of 60000 bytes" in liar.recv(n)
    source = torch.randn(BIG)
    msg = sender.encode(source, "t", "r", ELSEWHERE)
    assert torch.equal(receiver().decode(msg, "t", request_id="r"), source)
    silent.close()


def test_many_consumers_pull_at_once(sender: TensorSender, server: PullServer) -> None:
    sources = [torch.full((BIG,), float(i)) for i in range(8)]
    msgs = [sender.encode(s, "t", f"req-{i}", ELSEWHERE) for i, s in enumerate(sources)]
    got: dict[int, torch.Tensor] = {}

    def consume(i: int) -> None:
        got[i] = receiver().decode(msgs[i], "t", request_id=f"req-{i}")

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(torch.equal(got[i], sources[i]) for i in range(8))
    assert server.served == 8


def test_the_orchestrator_turns_a_pull_ref_into_bytes_for_a_client(
    sender: TensorSender,
) -> None:
    source = torch.randn(BIG)
    msg = sender.encode(source, "t", "req-1", ELSEWHERE)
    reader = RefReader(f"m{uuid.uuid4().hex[:6]}", token="mesh-token-0123456789")
    raw = reader.read(msg, "segment.tensors[0]", "req-1")
    assert raw.WhichOneof("data") == "raw" and raw.name == "t"
    assert torch.equal(codec.from_proto(raw), source)


def test_a_server_bound_to_every_address_must_be_told_what_to_advertise() -> None:
    with pytest.raises(ValueError, match="say which one to advertise"):
        PullServer(bind="0.0.0.0")
    with PullServer(bind="0.0.0.0", advertise="127.0.0.1") as server:
        assert server.address.startswith("127.0.0.1:")


def test_pulls_in_a_row_share_a_connection_and_one_the_producer_closed_is_redialled(
    sender: TensorSender, server: PullServer
) -> None:
    sources = [torch.full((BIG,), float(i)) for i in range(3)]
    msgs = [sender.encode(s, "t", "r", ELSEWHERE) for s in sources]
    for msg, source in zip(msgs[:2], sources[:2], strict=True):
        assert torch.equal(receiver().decode(msg, "t", request_id="r"), source)
    assert server.connections == 1 and server.served == 2
    # The producer drops the kept connection (as after its idle time): the next
    # pull finds it closed before any answer and goes again on a new one.
    with server._lock:
        kept = list(server._open)
    for conn in kept:
        conn.shutdown(socket.SHUT_RDWR)
    time.sleep(0.1)
    assert torch.equal(receiver().decode(msgs[2], "t", request_id="r"), sources[2])
    assert server.connections == 2 and server.served == 3


def _stripe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pull-stripe"]


def test_a_large_tensor_is_pulled_over_several_connections_at_once(
    sender: TensorSender, server: PullServer
) -> None:
    """From STRIPE_BYTES a pull is STREAMS ranges on as many connections: each byte
    lands where it belongs (a count, so a range out of place shows), the size need
    not divide, and no stripe thread is left behind."""
    count = STRIPE_BYTES // 8 + 12345  # int64: not a whole number of pages
    source = torch.arange(count, dtype=torch.int64)
    msg = sender.encode(source, "t", "req-1", ELSEWHERE)
    assert msg.WhichOneof("data") == "pull"
    got = receiver().decode(msg, "t", request_id="req-1")
    assert torch.equal(got, source)
    assert server.served == STREAMS and server.connections == STREAMS
    assert not _stripe_threads()
    small = sender.encode(torch.randn(BIG), "t", "req-1", ELSEWHERE)  # one range
    receiver().decode(small, "t", request_id="req-1")
    assert server.served == STREAMS + 1 and server.connections == STREAMS


def test_a_refused_large_pull_fails_once_every_stripe_is_done(
    sender: TensorSender, server: PullServer
) -> None:
    source = torch.randn(STRIPE_BYTES // 4)
    msg = sender.encode(source, "t", "req-1", ELSEWHERE)
    with pytest.raises(FailedPrecondition, match=r"t\.pull: .*held for another request"):
        receiver().decode(msg, "t", request_id="req-2")
    assert not _stripe_threads() and server.served == 0
    # the producer serves on: the right request's pull goes through
    assert torch.equal(receiver().decode(msg, "t", request_id="req-1"), source)
    assert server.served == STREAMS and not _stripe_threads()
