"""Tensor bytes a consumer pulls straight from the stage that holds them.

Stages that cannot map each other's memory (another node, another IPC
namespace) used to hand a large tensor over as chunks on the gRPC streams,
through the orchestrator: two hops, each copying the bytes several times inside
gRPC (64 MiB at about half ZeroMQ's speed, docs/benchmarks.md). Instead the
producing stage keeps the tensor where it is and sends a PullRef (its data
port, a random key, the size); the consumer reads the bytes over one TCP
connection straight into the tensor's memory, as Mooncake's and NIXL's
transfer engines do for KV caches: the kernel's two copies, like ZeroMQ's, and
the orchestrator carries only the ref.

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
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from services.mesh.data.chunks import Buffer, destination
from services.mesh.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from services.mesh.pb.omni.v1 import tensor_pb2

logger = logging.getLogger(__name__)

MAGIC = b"OMNIPULL1"
KEY_BYTES = 16
_OK, _REFUSED = 0, 1
_HEAD = struct.Struct(">BQ")
_RANGE = struct.Struct(">QQ")
# How long a connection may take to say what it wants, and a pull to make progress.
_IO_TIMEOUT_S = 30.0
_MAX_FIELD = 1024  # a token or request id longer than this is not one of ours
# Connections served at once (a consumer keeps up to _KEPT_PER_PRODUCER open for
# a moment after its pulls); more wait in the listen backlog.
_MAX_SERVING = 128
# A producer closes a connection idle this long; a consumer reuses one only if it
# was idle for less than _REUSE_S, so the producer never closes one in use.
_IDLE_S = 10.0
_REUSE_S = 5.0
_KEPT_PER_PRODUCER = 4  # idle connections a consumer keeps to one producer


@dataclass
class _Held:
    view: memoryview
    owner: str
    born: float
    keep: object  # what owns the memory (a tensor): alive while held


def key_name(key: bytes) -> str:
    """A held tensor's name in ReleaseTensors.names."""
    return f"pull-{key.hex()}"


class PullServer:
    """The producer's data port: serves the bytes it holds to whoever names them."""

    def __init__(
        self,
        *,
        bind: str = "127.0.0.1",
        advertise: str = "",
        port: int = 0,
        token: str | None = None,
        ttl_s: float = 300.0,
        max_held_bytes: int = 4 << 30,
    ) -> None:
        """``advertise``: the host consumers dial (``bind`` when empty, which must then
        be a concrete address); ``token``: the mesh token every pull must carry."""
        self._listener = socket.create_server((bind, port), backlog=128)
        host = advertise or bind
        if host in ("0.0.0.0", "::", ""):
            raise ValueError(f"bind {bind!r} is every address: say which one to advertise")
        bound = self._listener.getsockname()[1]
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        self._token = (token or "").encode()
        self._ttl_s = ttl_s
        self.max_held_bytes = max_held_bytes
        self._held: dict[bytes, _Held] = {}
        self._held_bytes = 0
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(_MAX_SERVING)
        self._open: set[socket.socket] = set()
        self._closed = False
        self.served = 0  # pulls answered with bytes
        self.connections = 0  # connections accepted
        self._thread = threading.Thread(target=self._accept, name="pull-server", daemon=True)
        self._thread.start()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held_bytes

    def live_names(self) -> list[str]:
        with self._lock:
            return [key_name(k) for k in self._held]

    def hold(self, data: memoryview, owner: str, keep: object) -> tensor_pb2.PullRef:
        """Hold ``data`` (bytes, C order) for request ``owner`` until released; the ref
        a consumer pulls it with. ResourceExhausted past ``max_held_bytes``."""
        view = data.cast("B")
        key = os.urandom(KEY_BYTES)
        with self._lock:
            if self._held_bytes + view.nbytes > self.max_held_bytes:
                raise ResourceExhausted(
                    f"pull: {self._held_bytes} bytes held, {view.nbytes} more would pass "
                    f"{self.max_held_bytes}",
                    field="pull",
                )
            self._held[key] = _Held(view, owner, time.monotonic(), keep)
            self._held_bytes += view.nbytes
        return tensor_pb2.PullRef(address=self.address, key=key, nbytes=view.nbytes)

    def release(self, owner: str | None = None, names: Iterable[str] = ()) -> int:
        """Free what ``owner`` holds and the tensors named (ReleaseTensors)."""
        wanted = set(names)
        with self._lock:
            gone = [
                k
                for k, held in self._held.items()
                if (owner is not None and held.owner == owner) or key_name(k) in wanted
            ]
            for key in gone:
                self._held_bytes -= self._held.pop(key).view.nbytes
        return len(gone)

    def expire(self, now: float | None = None) -> int:
        """Free what nobody released within the TTL."""
        cutoff = (time.monotonic() if now is None else now) - self._ttl_s
        with self._lock:
            gone = [k for k, held in self._held.items() if held.born < cutoff]
            for key in gone:
                self._held_bytes -= self._held.pop(key).view.nbytes
        return len(gone)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5.0)
        with self._lock:
            self._held.clear()
            self._held_bytes = 0
            still = list(self._open)
        for conn in still:  # kept-alive connections: their threads end now
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> PullServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            self._slots.acquire()
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._open.add(conn)
        try:
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while not self._closed and self._answer(conn):
                    pass
        except OSError as exc:  # the consumer went away: its side reports it
            logger.info("pull: connection ended early: %s", exc)
        finally:
            with self._lock:
                self._open.discard(conn)
            self._slots.release()

    def _answer(self, conn: socket.socket) -> bool:
        """Serve the connection's next pull; False when it is over (closed by the
        consumer, idle past _IDLE_S, or out of step after a malformed request)."""
        conn.settimeout(_IDLE_S)
        try:
            first = conn.recv(1)
        except TimeoutError:
            return False
        if not first:
            return False
        conn.settimeout(_IO_TIMEOUT_S)
        try:
            view = self._lookup(conn, first)
        except _Refused as exc:
            reason = str(exc).encode()
            conn.sendall(_HEAD.pack(_REFUSED, len(reason)) + reason)
            return exc.in_step
        conn.sendall(_HEAD.pack(_OK, view.nbytes))
        conn.sendall(view)
        with self._lock:
            self.served += 1
        return True

    def _lookup(self, conn: socket.socket, first: bytes) -> memoryview:
        if first + _read(conn, len(MAGIC) - 1) != MAGIC:
            raise _Refused("not an omni pull (expected OMNIPULL1)", in_step=False)
        token = _read(conn, _field_len(conn))
        request_id = _read(conn, _field_len(conn)).decode(errors="replace")
        key = _read(conn, KEY_BYTES)
        offset, nbytes = _RANGE.unpack(_read(conn, _RANGE.size))
        if self._token and not hmac.compare_digest(token, self._token):
            raise _Refused("the mesh token is missing or wrong", in_step=False)
        with self._lock:
            held = self._held.get(key)
        if held is None:
            raise _Refused("gone (released, expired, or never held here)", in_step=True)
        if held.owner != request_id:
            raise _Refused(f"held for another request, not {request_id!r}", in_step=True)
        if offset + nbytes > held.view.nbytes:
            raise _Refused(
                f"bytes {offset}-{offset + nbytes} of {held.view.nbytes} held", in_step=True
            )
        return held.view[offset : offset + nbytes]


class _Refused(Exception):
    """A pull answered with why not; ``in_step``: the whole request was read, so
    the connection can carry the next one."""

    def __init__(self, reason: str, *, in_step: bool) -> None:
        super().__init__(reason)
        self.in_step = in_step


def _field_len(conn: socket.socket) -> int:
    (n,) = struct.unpack(">H", _read(conn, 2))
    if n > _MAX_FIELD:
        raise _Refused(f"a field of {n} bytes (at most {_MAX_FIELD})", in_step=False)
    return n


def _read(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        got = conn.recv(n - len(data))
        if not got:
            raise _Refused("connection ended mid-request", in_step=False)
        data += got
    return bytes(data)


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
    hello = b"".join(
        (
            MAGIC,
            struct.pack(">H", len(secret)),
            secret,
            struct.pack(">H", len(rid)),
            rid,
            ref.key,
            _RANGE.pack(ref.offset, ref.nbytes),
        )
    )
    address = (host.strip("[]"), int(port))
    try:
        conn, reused = _connection(address)
        try:
            try:
                _exchange(conn, hello, into.cast("B"), where, ref)
            except _Stale:
                if not reused:
                    raise
                conn.close()  # the producer closed it meanwhile: once more, on a new one
                conn = _dial(address)
                _exchange(conn, hello, into.cast("B"), where, ref)
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


def _exchange(
    conn: socket.socket, hello: bytes, into: memoryview, where: str, ref: tensor_pb2.PullRef
) -> None:
    """One pull on ``conn``; _Stale when it ended before any answer (a kept
    connection the producer had closed). A refusal leaves the connection in step."""
    conn.sendall(hello)
    head = bytearray(_HEAD.size)
    try:
        got = conn.recv_into(head, _HEAD.size, socket.MSG_WAITALL)
    except ConnectionResetError:
        raise _Stale from None
    if got == 0:
        raise _Stale
    if got < _HEAD.size:
        _recv_into(conn, memoryview(head)[got:], where, ref.address)
    status, n = _HEAD.unpack(head)
    if status != _OK:
        said = _recv_exact(conn, min(n, 4096), where, ref.address).decode(errors="replace")
        raise FailedPrecondition(f"{where}: {ref.address} refused the pull: {said}", field=where)
    if n != ref.nbytes:
        raise FailedPrecondition(
            f"{where}: {ref.address} holds {n} bytes, the ref says {ref.nbytes}", field=where
        )
    _recv_into(conn, into, where, ref.address)


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
    conn = socket.create_connection(address, timeout=_IO_TIMEOUT_S)
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
