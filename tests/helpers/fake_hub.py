"""A loopback stand-in for the Hugging Face Hub: enough of its HTTP API for
``huggingface_hub.snapshot_download`` of one model repository (plain HTTP, no Xet).

    with FakeHub("org/name", {"config.json": b"{}"}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self, repo_id: str, files: dict[str, bytes], commit: str = "c0ffee" * 6 + "c0fe"):
        assert len(commit) == 40
        self.repo_id = repo_id
        self.files = files
        self.commit = commit
        self.downloads: list[str] = []  # file names whose bytes were sent (GET, not HEAD)
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self._httpd is not None, "hub not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        threading.Thread(
            target=self._httpd.serve_forever, args=(0.05,), name="fake-hub", daemon=True
        ).start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._httpd is not None
        self._httpd.shutdown()
        self._httpd.server_close()

    def _route(self, path: str) -> tuple[int, bytes, dict[str, str], str | None]:
        """(status, body, headers, name of the repo file served or None)."""
        api = f"/api/models/{self.repo_id}/"
        as_json = {"Content-Type": "application/json"}
        if path.startswith(api + "revision/"):
            siblings = [{"rfilename": name} for name in self.files]
            info = {"id": self.repo_id, "sha": self.commit, "siblings": siblings}
            return 200, json.dumps(info).encode(), as_json, None
        if path.startswith(api + "tree/"):
            tree = [
                {"type": "file", "path": name, "size": len(data), "oid": _oid(data)}
                for name, data in self.files.items()
            ]
            return 200, json.dumps(tree).encode(), as_json, None
        resolve = f"/{self.repo_id}/resolve/"
        if path.startswith(resolve):
            _revision, _, name = path.removeprefix(resolve).partition("/")
            if name in self.files:
                data = self.files[name]
                headers = {"X-Repo-Commit": self.commit, "ETag": f'"{_oid(data)}"'}
                return 200, data, headers, name
        return 404, b'{"error": "not found"}', as_json, None


def _oid(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            return None

        def _answer(self, with_body: bool) -> None:
            status, body, headers, served = hub._route(unquote(urlsplit(self.path).path))
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                if served is not None:
                    hub.downloads.append(served)
                self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer(with_body=True)

        def do_HEAD(self) -> None:
            self._answer(with_body=False)

    return Handler
