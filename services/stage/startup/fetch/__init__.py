"""Model fetch: turn a model source into a path on local disk, reporting through a hook.

Accepted sources (docs/design.md, 'The init watchdog'):

- a local file or folder: ``/abs``, ``rel/path``, ``~/x``, ``file:///abs``
- a file shipped in an installed package: ``pkg://<python_package>/<file>``
- ``http://`` / ``https://``, resumable, optionally ``#sha256=<hex>``; a URL
  ending in ``.tar``, ``.tar.gz`` or ``.tgz`` is extracted and the folder returned
- ``hf://org/name[@revision]`` through huggingface_hub's cache

Every successful fetch calls ``hook.start`` then ``hook.done``, so an operator
sees DOWNLOAD_START / DOWNLOAD_DONE with ``cache_hit`` and bytes for every source.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from services.mesh.errors import InitFailed
from services.stage.startup.fetch.download import fetch_http
from services.stage.startup.fetch.hook import (
    DownloadHook,
    FetchCancel,
    FetchCancelled,
    FetchResult,
    path_size,
)
from services.stage.startup.fetch.hub import fetch_hub
from services.stage.startup.fetch.local import resolve_local, resolve_package_file

__all__ = [
    "ACCEPTED_FORMS",
    "DownloadHook",
    "FetchCancel",
    "FetchCancelled",
    "FetchResult",
    "fetch_model",
]

logger = logging.getLogger(__name__)

ACCEPTED_FORMS = (
    "a local path (/abs, relative, ~/…, file:///abs)",
    "pkg://<python_package>/<file>",
    "http(s)://…[#sha256=<hex>] (.tar, .tar.gz, .tgz are extracted)",
    "hf://org/name[@revision]",
)

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def fetch_model(
    source: str,
    cache_dir: Path,
    hook: DownloadHook,
    *,
    stall_timeout_s: float = 60.0,
    progress_interval_s: float = 0.2,
    cancel: FetchCancel | None = None,
) -> FetchResult:
    """Make ``source`` available on local disk. Blocks: the stage calls it in a thread.

    Raises ``InitFailed`` with a message fit for an operator on any failure, and
    ``FetchCancelled`` soon after ``cancel`` is set (an HTTP download keeps its
    partial file; a hub download finishes the file it is on first).
    """
    if not source.strip():
        raise InitFailed("model source is empty; accepted: " + "; ".join(ACCEPTED_FORMS))
    match = _SCHEME.match(source)
    scheme = match.group(1).lower() if match else None
    if scheme in ("http", "https"):
        return fetch_http(
            source,
            cache_dir,
            hook,
            stall_timeout_s=stall_timeout_s,
            progress_interval_s=progress_interval_s,
            cancel=cancel,
        )
    if scheme == "hf":
        return fetch_hub(source, hook, progress_interval_s=progress_interval_s)
    if scheme == "pkg":
        return _already_local(source, resolve_package_file(source), hook)
    if scheme in (None, "file"):
        return _already_local(source, resolve_local(source), hook)
    raise InitFailed(
        f"model source {source!r}: unknown scheme {scheme!r}; accepted: "
        + "; ".join(ACCEPTED_FORMS)
    )


def _already_local(source: str, path: Path, hook: DownloadHook) -> FetchResult:
    """Nothing to download; the events are still published so every stage reports alike."""
    started = time.monotonic()
    nbytes = path_size(path)
    hook.start(source, nbytes)
    result = FetchResult(path, nbytes, True, source)
    logger.info("model %s is local at %s", source, path)
    hook.done(result, time.monotonic() - started)
    return result
