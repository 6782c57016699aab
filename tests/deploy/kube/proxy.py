"""A TCP relay between the orchestrator and the API server, standing in for the
network: ``cut()`` drops every connection through it (a watch dropped), and while
``closed()`` new ones are refused (the API out of reach), so what changes meanwhile
reaches the orchestrator only when it connects again."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class Relay:
    def __init__(self, target_port: int) -> None:
        self._target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True, name="relay").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._open.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self.accepted += 1
                self._sockets |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Drops every connection through the relay now."""
        with self._lock:
            ends, self._sockets = self._sockets, set()
        for end in ends:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        """Refuses new connections and drops the live ones, until the block ends."""
        self._open.clear()
        self.cut()
        try:
            yield
        finally:
            self._open.set()

    def close(self) -> None:
        self._listener.close()
        self.cut()
