"""The producer's side of a pull (``services.mesh.data.pull`` has the wire): a data
port, a thread serving plain TCP beside the stage's gRPC server, answering each
pull with bytes straight from the tensor it holds."""

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

from services.mesh.data.pull import (
    HEAD,
    IDLE_S,
    IO_TIMEOUT_S,
    KEY_BYTES,
    MAGIC,
    OK,
    RANGE,
    REFUSED,
    key_name,
)
from services.mesh.errors import ResourceExhausted
from services.mesh.pb.omni.v1 import tensor_pb2

logger = logging.getLogger(__name__)

_MAX_FIELD = 1024  # a token or request id longer than this is not one of ours
# Connections served at once (a consumer keeps a few open, pull._KEPT_PER_PRODUCER, for
# a moment after its pulls); more wait in the listen backlog.
_MAX_SERVING = 128


@dataclass
class _Held:
    view: memoryview
    owner: str
    born: float


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
        self.served = 0  # pulls answered with bytes (counted as the answer starts)
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

    def hold(self, data: memoryview, owner: str) -> tensor_pb2.PullRef:
        """Hold ``data`` (bytes, C order; the view keeps its memory alive) for request
        ``owner`` until released; the ref
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
            self._held[key] = _Held(view, owner, time.monotonic())
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
        consumer, idle past IDLE_S, or out of step after a malformed request)."""
        conn.settimeout(IDLE_S)
        try:
            first = conn.recv(1)
        except TimeoutError:
            return False
        if not first:
            return False
        conn.settimeout(IO_TIMEOUT_S)
        try:
            view = self._lookup(conn, first)
        except _Refused as exc:
            reason = str(exc).encode()
            conn.sendall(HEAD.pack(REFUSED, len(reason)) + reason)
            return exc.in_step
        with self._lock:  # counted before the bytes go: a consumer holding them sees it
            self.served += 1
        conn.sendall(HEAD.pack(OK, view.nbytes))
        conn.sendall(view)
        return True

    def _lookup(self, conn: socket.socket, first: bytes) -> memoryview:
        if first + _read(conn, len(MAGIC) - 1) != MAGIC:
            raise _Refused("not an omni pull (expected OMNIPULL1)", in_step=False)
        token = _read(conn, _field_len(conn))
        request_id = _read(conn, _field_len(conn)).decode(errors="replace")
        key = _read(conn, KEY_BYTES)
        offset, nbytes = RANGE.unpack(_read(conn, RANGE.size))
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
