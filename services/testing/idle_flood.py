"""Idle HTTP/2 connections, by hand: each sends the preface, its SETTINGS and one
HEADERS frame that opens a gRPC call, then never a message; it answers the
server's SETTINGS and PINGs like a live client, so keepalive never drops it.
This is how an attacker holds a server's descriptors and calls without a token
(auth is checked per call, after the connection and the call exist).

Used by the hostile catalogue (test_idle_connections.py) and benchmarks/soak.py.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0, 1, 3, 4, 6, 7
ACK, END_STREAM, END_HEADERS = 0x1, 0x1, 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header field, never indexed, no Huffman (names < 127 bytes)."""
    raw_name, raw_value = name.encode(), value.encode()
    return bytes([0x10, len(raw_name)]) + raw_name + bytes([len(raw_value)]) + raw_value


def call_headers(path: str, authority: str, token: str = "", stream: int = 1) -> bytes:
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    if token:
        fields.append(("authorization", f"Bearer {token}"))
    block = b"".join(_literal(name, value) for name, value in fields)
    return frame(HEADERS, END_HEADERS, stream, block)


class IdleFlood:
    """``count`` idle connections to ``host:port``, each with one call open on
    ``path`` (with ``token``: a caller the server knows; with ``declared_bytes``:
    the call starts a message of that size and sends only its first kilobyte, a
    slow sender); a thread answers the server until ``stop``. Counts what the
    server did to them: calls it ended (RST_STREAM, or trailers) and connections
    it closed."""

    def __init__(
        self, host: str, port: int, count: int, path: str, token: str = "", declared_bytes: int = 0
    ) -> None:
        self.address = (host, port)
        self.count = count
        self.path = path
        self.token = token
        self.declared_bytes = declared_bytes
        self.sockets: list[socket.socket] = []
        self.calls_ended = 0
        self.closed = 0
        self.goaways = 0
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="idle-flood", daemon=True)
        self._buffers: dict[socket.socket, bytes] = {}

    def start(self) -> IdleFlood:
        hello = (
            PREFACE
            + frame(SETTINGS, 0, 0)
            + call_headers(self.path, f"{self.address[0]}:{self.address[1]}", self.token)
        )
        if self.declared_bytes:  # a gRPC message's prefix (uncompressed, its length), then 1 KiB
            prefix = b"\x00" + self.declared_bytes.to_bytes(4, "big")
            hello += frame(DATA, 0, 1, prefix + bytes(1024))
        for _ in range(self.count):
            sock = socket.create_connection(self.address, timeout=5)
            try:
                sock.sendall(hello)
            except OSError:  # closed at once: the server is at its connection cap
                self.closed += 1
                sock.close()
                continue
            sock.setblocking(False)
            self.sockets.append(sock)
            self._buffers[sock] = b""
            self._selector.register(sock, selectors.EVENT_READ)
        self._thread.start()
        return self

    @property
    def open(self) -> int:
        return len(self._buffers)

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _events in self._selector.select(timeout=0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._drop(sock)
                    continue
                self._buffers[sock] += data
                self._frames(sock)

    def _frames(self, sock: socket.socket) -> None:
        buffer = self._buffers[sock]
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + length:
                break
            kind, flags = buffer[3], buffer[4]
            payload = buffer[9 : 9 + length]
            buffer = buffer[9 + length :]
            reply = b""
            if kind == SETTINGS and not flags & ACK:
                reply = frame(SETTINGS, ACK, 0)
            elif kind == PING and not flags & ACK:
                reply = frame(PING, ACK, 0, payload)
            elif kind == RST_STREAM or (kind == HEADERS and flags & END_STREAM):
                self.calls_ended += 1
            elif kind == GOAWAY:
                self.goaways += 1
            if reply:
                try:
                    sock.sendall(reply)
                except OSError:
                    self._drop(sock)
                    return
        self._buffers[sock] = buffer

    def _drop(self, sock: socket.socket) -> None:
        if self._buffers.pop(sock, None) is not None:
            self._selector.unregister(sock)
            sock.close()
            self.closed += 1

    def wait_closed(self, timeout_s: float) -> bool:
        """True once the server has closed every connection."""
        until = time.monotonic() + timeout_s
        while self.open and time.monotonic() < until:
            time.sleep(0.1)
        return not self.open

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for sock in list(self._buffers):
            self._selector.unregister(sock)
            sock.close()
        self._buffers.clear()
        self._selector.close()
