"""Tensor bytes a consumer pulls straight from the stage that holds them.

Stages that cannot map each other's memory (another node, another IPC
namespace) used to hand a large tensor over as chunks on the gRPC streams,
through the orchestrator: two hops, each copying the bytes several times inside
gRPC (64 MiB at about half ZeroMQ's speed, docs/benchmarks.md). Instead the
producing stage keeps the tensor where it is and sends a PullRef (its data
port, a random key, the size); the consumer reads the bytes over TCP straight
into the tensor's memory, as Mooncake's and NIXL's transfer engines do for KV
caches: the kernel's two copies, like ZeroMQ's, and the orchestrator carries only
the ref. From STRIPE_BYTES a pull is STREAMS ranges on as many connections at
once.

The wire, integers big-endian; a connection carries one pull after another (the
consumer keeps a few open per producer for a moment, so a pull costs one round
trip, not a new connection and a new thread on the producer)::

    consumer → producer   b"OMNIPULL1" | u16 n | mesh token (n bytes, may be 0)
                          | u16 m | request id (m bytes) | key (16 bytes)
                          | u64 offset | u64 nbytes (a range of what the key holds)
    producer → consumer   u8 status | u64 n | n bytes
                          status 0: the tensor's bytes; 1: why not, UTF-8

The key is a 128-bit secret that only travels inside the mesh (clients' refs
are refused); the request id must be the one the bytes were held for, as with
shared blocks; when the mesh has a token, a pull must carry it. Held bytes are
freed by ReleaseTensors (the key is the name), when their request is released,
after a TTL, or when the stage stops.

This module is the wire and the consumer's side; ``pull_server`` the producer's.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

from services.mesh.data.chunks import Buffer, destination
from services.mesh.data.wire import nbytes_of
from services.mesh.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.mesh.pb.omni.v1 import tensor_pb2

MAGIC = b"OMNIPULL1"
KEY_BYTES = 16
OK, REFUSED = 0, 1
HEAD = struct.Struct(">BQ")
RANGE = struct.Struct(">QQ")
# How long a connection may take to say what it wants, and a pull to make progress.
IO_TIMEOUT_S = 30.0
# A producer closes a connection idle this long; a consumer reuses one only if it
# was idle for less than _REUSE_S, so the producer never closes one in use.
IDLE_S = 10.0
_REUSE_S = 5.0
_KEPT_PER_PRODUCER = 4  # idle connections a consumer keeps to one producer
# From this size a pull goes as STREAMS ranges over as many connections at once, as
# NCCL's socket transport splits a transfer over several sockets: one TCP stream is
# held by the one core that runs its send path (on loopback, its receive path as
# well), so a second stream moves as much again beside it. 64 MiB on loopback: one
# stream 36-49 ms p50, two 22-29, three or four no better (docs/benchmarks.md).
STRIPE_BYTES = 8 << 20
STREAMS = 2
_PAGE = 4096


def key_name(key: bytes) -> str:
    """A held tensor's name in ReleaseTensors.names."""
    return f"pull-{key.hex()}"


def checked_size(msg: tensor_pb2.Tensor, field: str) -> int:
    """The bytes ``msg``'s dtype and shape imply, which its PullRef must hold: a ref
    that says otherwise is refused before any byte is pulled."""
    expected = nbytes_of(msg, field)
    if msg.pull.nbytes != expected:
        raise InvalidArgument(
            f"{field}.pull.nbytes: {msg.pull.nbytes}, but dtype {msg.dtype} and shape "
            f"{list(msg.shape)} need {expected}",
            field=f"{field}.pull.nbytes",
        )
    return expected


def pull(
    ref: tensor_pb2.PullRef, *, field: str, request_id: str, token: str | None = None
) -> Buffer:
    """The bytes ``ref`` names, read from its producer into fresh memory."""
    buffer = destination(ref.nbytes)
    pull_into(ref, memoryview(buffer), field=field, request_id=request_id, token=token)
    return buffer


def pull_into(
    ref: tensor_pb2.PullRef,
    into: memoryview,
    *,
    field: str,
    request_id: str,
    token: str | None = None,
) -> None:
    """The bytes ``ref`` names, read from its producer into ``into`` (``ref.nbytes``
    long: a tensor's own memory, say, which malloc hands back warm where a fresh
    mapping faults every page in as the bytes land)."""
    where = f"{field}.pull"
    host, _, port = ref.address.rpartition(":")
    if not host or not port.isdigit() or len(ref.key) != KEY_BYTES:
        raise InvalidArgument(
            f"{where}: expected address host:port and a {KEY_BYTES}-byte key, got "
            f"{ref.address!r} and {len(ref.key)} bytes",
            field=where,
        )
    if into.nbytes != ref.nbytes:
        raise ValueError(f"pull_into: {into.nbytes} bytes to fill, the ref holds {ref.nbytes}")
    secret, rid = (token or "").encode(), request_id.encode()
    greeting = b"".join(
        (MAGIC, struct.pack(">H", len(secret)), secret, struct.pack(">H", len(rid)), rid, ref.key)
    )
    address = (host.strip("[]"), int(port))
    out = into.cast("B")
    ranges = _stripes(ref.nbytes)
    errors: list[BaseException] = []

    def stripe(start: int, end: int) -> None:
        try:
            _pull_range(address, greeting, ref, start, end, out, where)
        except BaseException as exc:  # raised again below, once every stripe is done
            errors.append(exc)

    helpers = [
        threading.Thread(target=stripe, args=pair, name="pull-stripe", daemon=True)
        for pair in ranges[1:]
    ]
    for helper in helpers:
        helper.start()
    try:
        _pull_range(address, greeting, ref, *ranges[0], out, where)
    finally:
        for helper in helpers:  # none may still be writing into ``into`` when we return
            helper.join()
    if errors:
        raise errors[0]


def _stripes(nbytes: int) -> list[tuple[int, int]]:
    """[start, end) ranges of a pull: one below STRIPE_BYTES, else STREAMS, each a
    whole number of pages but the last."""
    if nbytes < STRIPE_BYTES:
        return [(0, nbytes)]
    step = (nbytes // STREAMS + _PAGE - 1) // _PAGE * _PAGE
    starts = range(0, nbytes, step)
    return [(start, min(start + step, nbytes)) for start in starts]


def _pull_range(
    address: tuple[str, int],
    greeting: bytes,
    ref: tensor_pb2.PullRef,
    start: int,
    end: int,
    out: memoryview,
    where: str,
) -> None:
    """Bytes [start, end) of what ``ref`` names into out[start:end], on a kept
    connection to the producer or a new one."""
    hello = greeting + RANGE.pack(ref.offset + start, end - start)
    into = out[start:end]
    try:
        conn, reused = _connection(address)
        try:
            try:
                _exchange(conn, hello, into, where, ref.address)
            except _Stale:
                if not reused:
                    raise
                conn.close()  # the producer closed it meanwhile: once more, on a new one
                conn = _dial(address)
                _exchange(conn, hello, into, where, ref.address)
        except BaseException:
            conn.close()
            raise
    except (ConnectionError, TimeoutError, socket.gaierror) as exc:
        raise Unavailable(f"{where}: cannot pull from {ref.address}: {exc}", field=where) from None
    except _Stale:
        raise Unavailable(
            f"{where}: cannot pull from {ref.address}: it closed the connection", field=where
        ) from None
    _keep(address, conn)


def _exchange(conn: socket.socket, hello: bytes, into: memoryview, where: str, source: str) -> None:
    """One pull on ``conn``; _Stale when it ended before any answer (a kept
    connection the producer had closed). A refusal leaves the connection in step."""
    conn.sendall(hello)
    head = bytearray(HEAD.size)
    try:
        got = conn.recv_into(head, HEAD.size, socket.MSG_WAITALL)
    except ConnectionResetError:
        raise _Stale from None
    if got == 0:
        raise _Stale
    if got < HEAD.size:
        _recv_into(conn, memoryview(head)[got:], where, source)
    status, n = HEAD.unpack(head)
    if status != OK:
        said = _recv_exact(conn, min(n, 4096), where, source).decode(errors="replace")
        raise FailedPrecondition(f"{where}: {source} refused the pull: {said}", field=where)
    if n != into.nbytes:
        raise FailedPrecondition(
            f"{where}: {source} sends {n} bytes, the pull asked {into.nbytes}", field=where
        )
    _recv_into(conn, into, where, source)


class _Stale(Exception):
    pass


_kept: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
_kept_lock = threading.Lock()


def _connection(address: tuple[str, int]) -> tuple[socket.socket, bool]:
    """A kept connection to ``address`` idle for less than _REUSE_S, else a new one."""
    now = time.monotonic()
    with _kept_lock:
        idle = _kept.get(address, [])
        while idle:
            conn, since = idle.pop()
            if now - since < _REUSE_S:
                return conn, True
            conn.close()
    return _dial(address), False


def _keep(address: tuple[str, int], conn: socket.socket) -> None:
    with _kept_lock:
        idle = _kept.setdefault(address, [])
        if len(idle) < _KEPT_PER_PRODUCER:
            idle.append((conn, time.monotonic()))
            return
    conn.close()


def _dial(address: tuple[str, int]) -> socket.socket:
    conn = socket.create_connection(address, timeout=IO_TIMEOUT_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _recv_exact(conn: socket.socket, n: int, where: str, address: str) -> bytes:
    buffer = bytearray(n)
    _recv_into(conn, memoryview(buffer), where, address)
    return bytes(buffer)


def _recv_into(conn: socket.socket, view: memoryview, where: str, address: str) -> None:
    got = 0
    while got < view.nbytes:
        # MSG_WAITALL: the kernel fills the rest in one call rather than returning
        # each time a socket buffer's worth arrived (hundreds of wake-ups for 64 MiB).
        n = conn.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if n == 0:
            raise Unavailable(
                f"{where}: {address} closed after {got} of {view.nbytes} bytes", field=where
            )
        got += n
