"""The tokenizer a speaker decodes its thinker's token ids with, loaded fast.

transformers reads a GGUF's tokenizer out of the file in ~10 s (and takes ~5 s
to import) on a 2-core machine: most of a speaker's start-up. Its
``tokenizer.json``, once written, loads with ``tokenizers`` in a fraction of a
second. So a GGUF's tokenizer is taken from the file's conversion where a
transformers stage has made one already (``gguf_cache.converted_target``), else
written once into the cache on its own (``tokenizer_target``): the stage's
PREPARE step, as a conversion is. A tokenizer folder is read through
transformers, as given (its own tokenizer_config.json may say more than its
tokenizer.json).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from services.engines.gguf_cache import converted_target, tokenizer_target
from services.engines.speech.text import Decoder

TOKENIZER = "tokenizer.json"


class _FastDecoder:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))

    def decode(self, token_ids: Any) -> str:
        text: str = self._tokenizer.decode(list(token_ids), skip_special_tokens=True)
        return text


class _HfDecoder:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, token_ids: Any) -> str:
        text: str = self._tokenizer.decode(
            list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return text


def _gguf(model_path: Path) -> bool:
    return model_path.is_file() and model_path.suffix == ".gguf"


def _written(model_path: Path, cache_dir: Path) -> Path | None:
    """A GGUF's tokenizer.json already in the cache, or None."""
    converted = converted_target(model_path, cache_dir)[1]
    for folder in (converted, tokenizer_target(model_path, cache_dir)):
        if (folder / TOKENIZER).is_file():
            return folder / TOKENIZER
    return None


def pending(model_path: Path, cache_dir: Path) -> str | None:
    """What ``write`` will do for ``model_path``, or None when nothing is left to."""
    if not _gguf(model_path) or _written(model_path, cache_dir) is not None:
        return None
    return f"reading the tokenizer out of {model_path.name} (once per file)"


def write(model_path: Path, cache_dir: Path) -> Path:
    """The GGUF's tokenizer.json, written into the cache on first use. Stages racing
    on the same file each write into a private temp folder and rename it into place;
    the loser keeps the winner's."""
    found = _written(model_path, cache_dir)
    if found is not None:
        return found
    from transformers import AutoTokenizer

    target = tokenizer_target(model_path, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        real = model_path.resolve()
        AutoTokenizer.from_pretrained(real.parent, gguf_file=real.name).save_pretrained(tmp)
        if not (tmp / TOKENIZER).is_file():
            raise RuntimeError(f"{model_path.name}'s tokenizer wrote no {TOKENIZER}")
        for path in tmp.iterdir():
            path.chmod(0o644)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / TOKENIZER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target / TOKENIZER


def decoder(model_path: Path, cache_dir: Path) -> Decoder:
    """The decoder for ``model_path``: a GGUF file or a tokenizer folder."""
    if _gguf(model_path):
        return _FastDecoder(write(model_path, cache_dir))
    from transformers import AutoTokenizer

    return _HfDecoder(AutoTokenizer.from_pretrained(model_path))
