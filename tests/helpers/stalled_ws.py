"""A WebSocket client that sends and never reads: a raw socket with a small
receive buffer that does the opening handshake and then writes masked text
frames (RFC 6455) while the server's replies pile up unread. A library client
reads in the background whatever flow control it claims, so a stalled reader
has to be made by hand."""

from __future__ import annotations

import base64
import os
import socket
import struct


class StalledClient:
    def __init__(self, host: str, port: int, path: str, receive_buffer: int = 16 << 10) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.connect((host, port))
        key = base64.b64encode(os.urandom(16)).decode()
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            "Authorization: Bearer x\r\n\r\n"
        )
        self.sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)  # byte by byte: nothing after the headers is read
            if not chunk:
                raise ConnectionError("closed during the handshake")
            head += chunk
        if not head.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(head.decode(errors="replace"))
        self.sock.settimeout(10)

    def send_text(self, text: str) -> None:
        payload = text.encode()
        mask = os.urandom(4)
        size = len(payload)
        if size < 126:
            header = struct.pack("!BB", 0x81, 0x80 | size)
        elif size < 1 << 16:
            header = struct.pack("!BBH", 0x81, 0x80 | 126, size)
        else:
            header = struct.pack("!BBQ", 0x81, 0x80 | 127, size)
        self.sock.sendall(header + mask + _masked(payload, mask))

    def read_all(self) -> bytes:
        """Everything the server sent up to its close frame, or until it hung up
        (the client reads again, at last)."""
        data = bytearray()
        self.sock.settimeout(30)
        while chunk := self.sock.recv(1 << 16):
            data += chunk
            if chunk.find(b"\x88") >= 0 and any(op == 8 for op, _ in frames(bytes(data))):
                break
        return bytes(data)

    def close(self) -> None:
        self.sock.close()


def _masked(payload: bytes, mask: bytes) -> bytes:
    whole = (mask * (len(payload) // 4 + 1))[: len(payload)]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(whole, "big")).to_bytes(
        len(payload), "big"
    )


def frames(data: bytes) -> list[tuple[int, bytes]]:
    """The server's (unmasked) frames in ``data``: (opcode, payload)."""
    out = []
    i = 0
    while i + 2 <= len(data):
        opcode, size = data[i] & 0x0F, data[i + 1] & 0x7F
        i += 2
        if size == 126:
            (size,) = struct.unpack("!H", data[i : i + 2])
            i += 2
        elif size == 127:
            (size,) = struct.unpack("!Q", data[i : i + 8])
            i += 8
        if i + size > len(data):
            break
        out.append((opcode, data[i : i + size]))
        i += size
    return out
