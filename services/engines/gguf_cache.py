"""Where a GGUF file's conversions live in the stage's cache (no heavy imports:
the speech engine finds its tokenizer here without loading transformers).

A conversion is keyed by the file's real path, size and modification time and by
``CONVERSION_FORMAT``, so a replaced file, or a converter that now writes another
layout, is converted again.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# Raised whenever a converted folder's layout changes, so folders written by an
# older converter are converted again.
# 2: tied weights under their source name, ``architectures`` in config.json.
CONVERSION_FORMAT = 2


def conversion_key(gguf: Path) -> tuple[Path, str]:
    """The file itself (symlinks followed) and its folder name in a cache."""
    real = gguf.resolve()
    stat = real.stat()
    key = f"{CONVERSION_FORMAT}\0{real}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return real, f"{hashlib.sha256(key.encode()).hexdigest()[:16]}-{real.stem}"


def converted_target(gguf: Path, cache_dir: Path) -> tuple[Path, Path]:
    """The file itself and its whole conversion's folder (weights and tokenizer)."""
    real, name = conversion_key(gguf)
    return real, cache_dir / "converted" / name


def tokenizer_target(gguf: Path, cache_dir: Path) -> Path:
    """The folder of its tokenizer alone, for engines that need nothing else."""
    return cache_dir / "tokenizers" / conversion_key(gguf)[1]
