"""A real HTTP file server on 127.0.0.1 for download tests: throttled, ranged, breakable.

    with FileServer(folder, rate_bps=512_000) as server:
        fetch(server.url("model.bin"))
        assert server.requests[-1].range == "bytes=1000-"

Settings are plain attributes read at every request, so a test may change them
between requests (cut the first attempt short, let the second through).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import unquote, urlsplit

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


@dataclass(frozen=True)
class RequestRecord:
    path: str
    range: str | None  # the Range header as sent, if any


class FileServer:
    """Serves the files below ``root``.

    rate_bps: throttle the body to about this many bytes per second (None: full speed).
    cut_after: send only this many body bytes, then close the connection.
    hang_after: send only this many body bytes, then hold the connection open
        without sending until the server stops (a stalled download).
    support_range: honour ``Range: bytes=N-`` with 206; False answers 200 with everything.
    """

    def __init__(
        self,
        root: Path,
        *,
        rate_bps: int | None = None,
        cut_after: int | None = None,
        hang_after: int | None = None,
        support_range: bool = True,
        chunk_size: int = 16 * 1024,
    ) -> None:
        self.root = root.resolve()
        self.rate_bps = rate_bps
        self.cut_after = cut_after
        self.hang_after = hang_after
        self.support_range = support_range
        self.chunk_size = chunk_size
        self.requests: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.hanging = threading.Event()  # set when a response stops at hang_after
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return int(self._httpd.server_address[1])

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    @property
    def ranges(self) -> list[str]:
        with self._lock:
            return [r.range for r in self.requests if r.range is not None]

    def start(self) -> FileServer:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        httpd.daemon_threads = True
        self._httpd = httpd
        # A short poll keeps stop() quick: shutdown waits for the loop to notice.
        self._thread = threading.Thread(
            target=httpd.serve_forever, args=(0.05,), name="file-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # lets hanging handlers return
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FileServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _record(self, record: RequestRecord) -> None:
        with self._lock:
            self.requests.append(record)


def _handler_for(server: FileServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            return None

        def do_GET(self) -> None:
            rel = unquote(urlsplit(self.path).path).lstrip("/")
            server._record(RequestRecord(rel, self.headers.get("Range")))
            path = (server.root / rel).resolve()
            if not path.is_relative_to(server.root) or not path.is_file():
                self.send_error(404)
                return
            data = path.read_bytes()
            start, end = 0, len(data)
            match = _RANGE.fullmatch(self.headers.get("Range", ""))
            if match and server.support_range:
                start = int(match.group(1))
                end = int(match.group(2)) + 1 if match.group(2) else len(data)
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            try:
                self._send_body(data[start:end])
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up, as stall tests expect

        def _send_body(self, body: bytes) -> None:
            limit = len(body)
            for cap in (server.cut_after, server.hang_after):
                if cap is not None:
                    limit = min(limit, cap)
            sent = 0
            while sent < limit and not server._stopping.is_set():
                chunk = body[sent : min(sent + server.chunk_size, limit)]
                self.wfile.write(chunk)
                self.wfile.flush()
                sent += len(chunk)
                if server.rate_bps:
                    time.sleep(len(chunk) / server.rate_bps)
            if server.hang_after is not None and sent < len(body):
                server.hanging.set()
                server._stopping.wait(timeout=60)

    return Handler
