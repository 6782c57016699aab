"""Model fetch against a loopback HTTP server: progress, resume, checksums, stalls,
and archives unpacked (hostile ones refused)."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import time
from pathlib import Path

import pytest

from services.mesh.errors import InitFailed
from services.stage.startup.fetch import fetch_model
from tests.helpers.http_server import FileServer
from tests.stage.startup.fetch.fetch_recording import RecordingHook, fetch


def cached_files(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "downloads").iterdir() if not p.name.endswith(".lock"))


def test_http_download_reports_progress_and_hides_secrets(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    data = os.urandom(256 * 1024)
    (tmp_path / "srv" / "model.bin").write_bytes(data)
    with FileServer(tmp_path / "srv", rate_bps=640 * 1024) as server:
        source = server.url("model.bin") + "?X-Signature=secret"
        result, hook = fetch(source, tmp_path / "cache", progress_interval_s=0.05)

    assert result.path.read_bytes() == data
    assert (result.nbytes, result.cache_hit) == (len(data), False)
    assert result.path.name.endswith("-model.bin")
    assert cached_files(tmp_path / "cache") == [result.path.name]  # no .partial left
    progress = hook.progress_events
    assert len(progress) >= 3, progress
    done = [d for d, _ in progress]
    assert done == sorted(set(done)) and done[-1] <= len(data)
    assert {total for _, total in progress} == {len(data)}
    assert "secret" not in result.source and "secret" not in str(hook.events[0])


def test_http_resume_after_a_cut_then_cache_hit(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    data = os.urandom(200 * 1024)
    (tmp_path / "srv" / "w.bin").write_bytes(data)
    cache = tmp_path / "cache"
    with FileServer(tmp_path / "srv", cut_after=100 * 1024) as server:
        with pytest.raises(InitFailed, match=r"connection closed at 102\.4 KB of 204\.8 KB"):
            fetch_model(server.url("w.bin"), cache, RecordingHook())
        assert server.ranges == []

        server.cut_after = None
        second, _ = fetch(server.url("w.bin"), cache)
        assert server.ranges == [f"bytes={100 * 1024}-"]
        assert second.path.read_bytes() == data and not second.cache_hit

        third, hook = fetch(server.url("w.bin"), cache)
        assert len(server.requests) == 2  # no request for a cache hit
        assert (third.path, third.cache_hit, third.nbytes) == (second.path, True, len(data))
        assert hook.events[0][2] == len(data)


def test_http_server_ignoring_range_restarts_from_zero(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    data = os.urandom(64 * 1024)
    (tmp_path / "srv" / "w.bin").write_bytes(data)
    with FileServer(tmp_path / "srv", cut_after=10_000, support_range=False) as server:
        with pytest.raises(InitFailed, match="resumes"):
            fetch_model(server.url("w.bin"), tmp_path / "cache", RecordingHook())
        server.cut_after = None
        result, _ = fetch(server.url("w.bin"), tmp_path / "cache")
        assert server.ranges == ["bytes=10000-"]  # asked, got a 200, started over
    assert result.path.read_bytes() == data


def test_http_sha256_fragment(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    data = os.urandom(10_000)
    (tmp_path / "srv" / "w.bin").write_bytes(data)
    good = hashlib.sha256(data).hexdigest()
    with FileServer(tmp_path / "srv") as server:
        with pytest.raises(InitFailed, match="sha256 mismatch"):
            fetch_model(
                server.url("w.bin") + "#sha256=" + "0" * 64, tmp_path / "bad", RecordingHook()
            )
        assert cached_files(tmp_path / "bad") == []  # neither the file nor a .partial is kept
        result, _ = fetch(server.url("w.bin") + "#sha256=" + good, tmp_path / "good")
    assert result.path.read_bytes() == data


def test_http_errors_name_status_and_url(tmp_path: Path) -> None:
    with FileServer(tmp_path) as server:
        with pytest.raises(InitFailed, match=r"HTTP 404 .*") as info:
            fetch_model(server.url("missing.bin"), tmp_path / "cache", RecordingHook())
    assert server.url("missing.bin") in str(info.value)


def test_http_stall_fails_within_the_stall_timeout(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "w.bin").write_bytes(os.urandom(64 * 1024))
    with FileServer(tmp_path / "srv", hang_after=16 * 1024) as server:
        started = time.monotonic()
        with pytest.raises(
            InitFailed, match=r"stalled: no bytes for 0\.5s at 16\.4 KB of 65\.5 KB"
        ):
            fetch_model(
                server.url("w.bin"), tmp_path / "cache", RecordingHook(), stall_timeout_s=0.5
            )
        elapsed = time.monotonic() - started
    assert 0.45 <= elapsed < 3.0


def make_tar(path: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)


def test_http_tar_gz_is_extracted_to_a_folder(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    members = {"model/config.json": b"{}", "model/weights/part0.bin": os.urandom(5000)}
    make_tar(tmp_path / "srv" / "model.tar.gz", members, links={"model/alias.json": "config.json"})
    with FileServer(tmp_path / "srv") as server:
        result, hook = fetch(server.url("model.tar.gz"), tmp_path / "cache")
        again, hook_again = fetch(server.url("model.tar.gz"), tmp_path / "cache")
        assert len(server.requests) == 1
    assert hook.events[-1][:2] == ("preparing", "unpacking model.tar.gz")
    assert hook_again.kinds == ["start", "done"]  # unpacked once, then a cache hit
    assert result.path.is_dir() and not result.cache_hit
    for name, payload in members.items():
        assert (result.path / name).read_bytes() == payload
    assert (result.path / "model" / "alias.json").read_bytes() == b"{}"
    # DOWNLOAD_DONE reports the bytes fetched: the archive's, not what it unpacks to.
    assert result.nbytes == (tmp_path / "srv" / "model.tar.gz").stat().st_size
    assert cached_files(tmp_path / "cache") == [result.path.name]  # the archive is gone
    assert (again.path, again.cache_hit) == (result.path, True)


@pytest.mark.parametrize(
    ("members", "links"),
    [
        ({"../evil.txt": b"x"}, None),
        ({"/tmp/evil.txt": b"x"}, None),
        ({"ok.txt": b"x"}, {"evil.txt": "../../../evil.txt"}),
    ],
    ids=["dotdot", "absolute", "symlink-out"],
)
def test_http_hostile_tar_is_refused(
    members: dict[str, bytes], links: dict[str, str] | None, tmp_path: Path
) -> None:
    (tmp_path / "srv").mkdir()
    make_tar(tmp_path / "srv" / "bad.tgz", members, links)
    with FileServer(tmp_path / "srv") as server:
        with pytest.raises(InitFailed, match="refused"):
            fetch_model(server.url("bad.tgz"), tmp_path / "cache", RecordingHook())
    # The refused archive is deleted too: a fixed archive at that URL is fetched anew.
    assert cached_files(tmp_path / "cache") == []
    assert not (tmp_path / "evil.txt").exists()
