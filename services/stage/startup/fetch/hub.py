"""``hf://org/name[@revision]`` sources through huggingface_hub's own cache.

huggingface_hub reads ``HF_HUB_OFFLINE``, ``HF_HOME`` and ``HF_ENDPOINT`` once,
when it is first imported. The fetch reads them again when it runs and passes
them on explicitly, so a cache location or offline mode set after that import
is still honoured (offline mode, once imported, cannot be lifted in-process).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from services.mesh.errors import InitFailed
from services.stage.startup.fetch.hook import DownloadHook, FetchResult, ProgressFeed, path_size

logger = logging.getLogger(__name__)

_SOURCE = re.compile(r"hf://(?P<repo>[\w.-]+(?:/[\w.-]+)?)(?:@(?P<revision>.+))?")
_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set now, or was
    when huggingface_hub was imported: its HTTP layer then refuses every request."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir() -> Path | None:
    """The hub cache the environment names now, in huggingface_hub's order of
    precedence; None leaves huggingface_hub's default."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    home = os.environ.get("HF_HOME")
    return Path(home).expanduser() / "hub" if home else None


def fetch_hub(source: str, hook: DownloadHook, *, progress_interval_s: float) -> FetchResult:
    match = _SOURCE.fullmatch(source)
    if match is None:
        raise InitFailed(f"model source {source!r}: expected hf://org/name[@revision]")
    repo_id, revision = match["repo"], match["revision"] or "main"
    offline = hub_offline()
    cache_dir = hub_cache_dir()

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    started = time.monotonic()
    hook.start(source, None)
    bars = _ByteBars(ProgressFeed(hook, progress_interval_s))
    try:
        folder = snapshot_download(
            repo_id,
            repo_type="model",
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=offline,
            tqdm_class=bars.bar_class,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
        )
    except LocalEntryNotFoundError as exc:
        where = cache_dir or "huggingface_hub's default cache"
        if offline:
            raise InitFailed(
                f"model {source}: not in the local cache ({where}) and HF_HUB_OFFLINE is set"
            ) from exc
        raise InitFailed(
            f"model {source}: not cached in {where} and the Hub failed: {exc}"
        ) from exc
    except GatedRepoError as exc:
        raise InitFailed(f"model {source}: gated repository; set HF_TOKEN with access") from exc
    except RepositoryNotFoundError as exc:
        raise InitFailed(
            f"model {source}: repository not found (or private: set HF_TOKEN)"
        ) from exc
    except RevisionNotFoundError as exc:
        raise InitFailed(f"model {source}: revision {revision!r} not found") from exc
    except HfHubHTTPError as exc:
        raise InitFailed(f"model {source}: Hub request failed: {exc}") from exc
    except OSError as exc:  # disk full, permissions: the operator must see why
        raise InitFailed(f"model {source}: {exc}") from exc

    path = Path(folder)
    # Offline success means the snapshot was complete on disk; online, nothing to
    # download means the same.
    result = FetchResult(path, path_size(path), offline or bars.bytes_done == 0, source)
    duration = time.monotonic() - started
    logger.info("fetched %s into %s (cache_hit=%s)", source, path, result.cache_hit)
    hook.done(result, duration)
    return result


class _ByteBars:
    """Stands in for tqdm in ``snapshot_download(tqdm_class=...)``.

    huggingface_hub makes one bar counting files, one counting network bytes whose
    total is a growing display estimate, and one counting bytes written to disk
    whose total grows by each file's size as its download begins. Only that last
    one is forwarded as byte progress. The bars are duck-typed rather than tqdm
    subclasses so that nothing is drawn and tqdm's internals are never touched.
    """

    def __init__(self, feed: ProgressFeed) -> None:
        self._feed = feed
        self._lock = threading.Lock()
        self.bytes_done = 0
        owner = self

        class Bar:
            def __init__(self, *_args: Any, **kwargs: Any) -> None:
                self.n: float = kwargs.get("initial") or 0
                self.total: float | None = kwargs.get("total")
                self.disk_bytes = kwargs.get("unit") == "B" and not str(
                    kwargs.get("desc", "")
                ).startswith("Downloading")

            def update(self, n: float | None = 1) -> None:
                with owner._lock:
                    self.n += n or 0
                    if not self.disk_bytes:
                        return
                    owner.bytes_done = int(self.n)
                    total = int(self.total) if self.total else None
                owner._feed.update(owner.bytes_done, total)

            @property
            def format_dict(self) -> dict[str, Any]:
                return {"n": self.n, "total": self.total, "rate": None}

            def __enter__(self) -> Bar:
                return self

            def __exit__(self, *_exc: object) -> None:
                return None

            def _ignore(self, *_args: Any, **_kwargs: Any) -> None:
                return None

            close = refresh = set_description = set_description_str = _ignore
            set_postfix = set_postfix_str = _ignore

        self.bar_class = Bar
