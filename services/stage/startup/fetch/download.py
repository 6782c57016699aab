"""``http(s)://`` sources: resumable download into the cache, integrity check, archives.

Layout under ``cache_dir/downloads``: ``<sha256(source)[:16]>-<basename>`` is the
finished file (it only ever appears by an atomic rename, so its existence is the
cache hit), ``….partial`` the bytes so far, ``….lock`` serialises stages on one
node fetching the same URL. An archive is extracted into the same name without
its suffix and then deleted, so a large model is kept on disk once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from urllib.error import HTTPError, URLError
from urllib.parse import unquote, urlsplit, urlunsplit
from urllib.request import Request, urlopen

from services.mesh.errors import InitFailed
from services.mesh.units import format_bytes
from services.stage.startup.fetch.archive import archive_suffix, extract_archive
from services.stage.startup.fetch.hook import (
    DownloadHook,
    FetchCancel,
    FetchResult,
    ProgressFeed,
    path_size,
)

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
_USER_AGENT = "omni-mesh"
_CONTENT_RANGE = re.compile(r"bytes (\d+)-\d+/(\d+|\*)")


def redact(url: str) -> str:
    """``url`` without user info, query or fragment: presigned URLs carry secrets there."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def fetch_http(
    source: str,
    cache_dir: Path,
    hook: DownloadHook,
    *,
    stall_timeout_s: float,
    progress_interval_s: float,
    cancel: FetchCancel | None = None,
) -> FetchResult:
    """Fetch ``source`` into the cache. ``cancel`` stops it between reads (or
    wakes a blocked read), keeping the partial file for the next attempt."""
    cancel = cancel or FetchCancel()
    url, _, fragment = source.partition("#")
    expected_sha = _parse_fragment(fragment, source)
    shown = redact(url)
    basename = re.sub(r"[^A-Za-z0-9._-]", "_", PurePosixPath(unquote(urlsplit(url).path)).name)
    folder = cache_dir / "downloads"
    # The fragment is part of the key: a new pinned digest must not be met by an old file.
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    final = folder / f"{key}-{basename or 'download'}"
    suffix = archive_suffix(final.name)
    target = final.with_name(final.name.removesuffix(suffix)) if suffix else final
    started = time.monotonic()

    if target.exists():  # complete: it only appears by rename
        return _cache_hit(target, shown, hook, started)
    hook.start(shown, None)
    folder.mkdir(parents=True, exist_ok=True)
    with _exclusive(final.with_name(final.name + ".lock"), cancel, shown):
        if target.exists():  # another stage on this node finished it while we waited
            result = FetchResult(target, path_size(target), True, shown)
            hook.done(result, time.monotonic() - started)
            return result
        downloaded = not final.exists()  # an archive survives only if extraction was cut short
        if downloaded:
            feed = ProgressFeed(hook, progress_interval_s)
            _download(url, shown, final, expected_sha, feed, stall_timeout_s, cancel)
        fetched = final.stat().st_size  # an archive's own bytes, before it is unpacked
        verified = downloaded and expected_sha is not None  # _download checked the digest
        result = FetchResult(target, fetched, not downloaded, shown, verified)
        duration = time.monotonic() - started
        logger.info("fetched %s: %s in %.1fs", shown, format_bytes(result.nbytes), duration)
        hook.done(result, duration)  # the bytes are here: unpacking is local work
        if suffix:
            hook.preparing(f"unpacking {final.name.removeprefix(key + '-')}")
            try:
                extract_archive(final, target)
            finally:
                # Refused or not, the archive goes: a fixed one at this URL is then fetched anew.
                final.unlink()
    return result


def _cache_hit(target: Path, shown: str, hook: DownloadHook, started: float) -> FetchResult:
    nbytes = path_size(target)
    hook.start(shown, nbytes)
    result = FetchResult(target, nbytes, True, shown)
    hook.done(result, time.monotonic() - started)
    return result


def _parse_fragment(fragment: str, source: str) -> str | None:
    if not fragment:
        return None
    match = re.fullmatch(r"sha256=([0-9a-fA-F]{64})", fragment)
    if match is None:
        raise InitFailed(
            f"model source {source!r}: the only URL fragment accepted is #sha256=<hex>"
        )
    return match.group(1).lower()


@contextlib.contextmanager
def _exclusive(lock_path: Path, cancel: FetchCancel, shown: str) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:  # polled, so that a stopping stage does not wait for a neighbour's download
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # freed by the kernel if we die
                break
            except BlockingIOError:
                if cancel.wait(0.2):
                    cancel.check(f"waiting for another download of {shown}")
        yield
    finally:
        os.close(fd)


def _download(
    url: str,
    shown: str,
    final: Path,
    expected_sha: str | None,
    feed: ProgressFeed,
    stall_timeout_s: float,
    cancel: FetchCancel,
) -> None:
    partial = final.with_name(final.name + ".partial")
    cancel.check(f"download of {shown}")
    offset = partial.stat().st_size if partial.exists() else 0
    headers = {"User-Agent": _USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        # The socket timeout bounds every single read: no byte for that long is a stall.
        response = urlopen(Request(url, headers=headers), timeout=stall_timeout_s)
    except HTTPError as exc:
        if exc.code == 416 and offset:  # the partial is no prefix of this resource any more
            partial.unlink()
            return _download(url, shown, final, expected_sha, feed, stall_timeout_s, cancel)
        raise InitFailed(f"download of {shown} failed: HTTP {exc.code} {exc.reason}") from exc
    except (URLError, TimeoutError) as exc:
        reason = exc.reason if isinstance(exc, URLError) else exc
        if isinstance(reason, TimeoutError):
            raise _stalled(shown, stall_timeout_s, offset, None) from exc
        raise InitFailed(f"download of {shown} failed: {reason}") from exc

    with response, cancel.on_cancel(lambda: _interrupt(response)):
        total: int | None = None
        length = response.headers.get("Content-Length")
        if response.status == 206 and offset:
            match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
            if match is None or int(match.group(1)) != offset:
                partial.unlink()
                raise InitFailed(
                    f"download of {shown}: server answered a resume with a wrong range"
                )
            total = int(match.group(2)) if match.group(2) != "*" else None
            mode = "ab"
            logger.info("resuming %s at %s", shown, format_bytes(offset))
        else:
            offset, mode = 0, "wb"  # a plain 200 sends the whole body: start over
        if total is None and length is not None:
            total = offset + int(length)

        digest = hashlib.sha256() if expected_sha else None
        if digest is not None and offset:
            with partial.open("rb") as prefix:
                for block in iter(lambda: prefix.read(_CHUNK), b""):
                    digest.update(block)

        done = offset
        with partial.open(mode) as out:
            while True:
                try:
                    chunk = response.read1(_CHUNK)
                except TimeoutError as exc:
                    cancel.check(f"download of {shown}")
                    raise _stalled(shown, stall_timeout_s, done, total) from exc
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    cancel.check(f"download of {shown}")
                    raise InitFailed(
                        f"download of {shown} broke off at {format_bytes(done)} of "
                        f"{format_bytes(total)} ({exc!r}); the next attempt resumes"
                    ) from exc
                cancel.check(f"download of {shown}")  # what was read so far stays in the partial
                if not chunk:
                    break
                out.write(chunk)
                if digest is not None:
                    digest.update(chunk)
                done += len(chunk)
                feed.update(done, total)

    if total is not None and done < total:
        # http.client reports a short body as a clean end of stream.
        raise InitFailed(
            f"download of {shown}: connection closed at {format_bytes(done)} of "
            f"{format_bytes(total)}; the next attempt resumes"
        )
    if digest is not None and digest.hexdigest() != expected_sha:
        partial.unlink()
        raise InitFailed(
            f"download of {shown}: sha256 mismatch (expected {expected_sha}, "
            f"got {digest.hexdigest()}); the file was deleted"
        )
    os.replace(partial, final)


def _interrupt(response: http.client.HTTPResponse) -> None:
    """Wake a read blocked on a silent server (from the cancelling thread)."""
    raw = getattr(response.fp, "raw", None)
    sock = getattr(raw, "_sock", None)
    if isinstance(sock, socket.socket):
        sock.shutdown(socket.SHUT_RDWR)


def _stalled(shown: str, stall_timeout_s: float, done: int, total: int | None) -> InitFailed:
    return InitFailed(
        f"download of {shown} stalled: no bytes for {stall_timeout_s:.1f}s "
        f"at {format_bytes(done)} of {format_bytes(total)}"
    )
