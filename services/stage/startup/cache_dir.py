"""The stage's cache directory, made and checked once, first thing at start-up.

Models are fetched into it, GGUF files converted into it, downloads resumed from
it. One that cannot be used fails init here, naming the setting it came from and
the path in words ("cache directory /data/omni (cache_dir in the stage file):
cannot create it: a part of the path is a file, not a directory"), rather than
as an errno from deep inside a fetch or a conversion (``NotADirectoryError:
[Errno 20] Not a directory: '/data/omni/converted'``).
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from services.mesh import environment
from services.mesh.errors import InitFailed
from services.stage.config import StageConfig

# What an operator can act on, for the errors a directory gives.
_WORDS = {
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.ENOENT: "a part of the path does not exist and cannot be made there",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "the file system is read-only",
    errno.ENOSPC: "the disk is full",
    errno.EEXIST: "it exists and is not a directory",
}


def ready_cache_dir(config: StageConfig) -> Path:
    """The cache directory, made if missing and checked writable; InitFailed
    (field ``cache_dir``) naming where the setting came from and why not."""
    path = config.resolved_cache_dir
    variable = environment.CACHE_DIR.name
    if config.cache_dir is not None:
        setting = "cache_dir in the stage file"
    elif os.environ.get(variable, "").strip():
        setting = f"{variable}, as the stage file sets no cache_dir"
    else:
        setting = f"the default, as neither cache_dir nor {variable} is set"
    doing = "create it"
    try:
        path.mkdir(parents=True, exist_ok=True)
        doing = "write in it"
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        words = _WORDS.get(exc.errno or 0) or (exc.strerror or str(exc)).lower()
        raise InitFailed(
            f"cache directory {path} ({setting}): cannot {doing}: {words}", field="cache_dir"
        ) from exc
    return path
