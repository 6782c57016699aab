"""Small real models built by the tests themselves (nothing is fetched from a hub)."""

from __future__ import annotations

import tarfile
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from services.engines.transformers.loading import converted_folder
from services.testing.configs import TINY_LLAMA


def tiny_llama_folder(dest: Path, smollm2_gguf: Path, cache_dir: Path) -> Path:
    """An HF model folder: SmolLM2's tokenizer on a tiny random-weight Llama."""
    source = converted_folder(smollm2_gguf, cache_dir)
    config = AutoConfig.from_pretrained(source)
    for key, value in TINY_LLAMA.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(source).save_pretrained(dest)
    return dest


def tar_folder(folder: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=path.name)
    return archive
