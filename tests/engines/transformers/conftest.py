"""The transformers engine on the real SmolLM2 (GGUF), shared by its test modules:
the model as is, and a tiny random-weight Llama with the real tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.engines.base import EngineSettings
from services.engines.transformers import TransformersEngine
from services.engines.transformers.loading import converted_folder
from services.testing.configs import TINY_LLAMA
from tests.helpers.text_engine import Tiny


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(EngineSettings(cache_dir=omni_cache_dir, max_batch_size=8))
    engine.load(smollm2_gguf)
    engine.warmup()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tiny_smollm2(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[Tiny]:
    """At most 8 prompt tokens."""
    torch.manual_seed(0)  # fixed random weights, so greedy output is reproducible
    settings = EngineSettings(
        load_format="dummy",
        max_prompt_tokens=8,
        cache_dir=omni_cache_dir,
        engine_args={"config_overrides": TINY_LLAMA},
    )
    engine = TransformersEngine(settings)
    info = engine.load(smollm2_gguf)
    yield Tiny(engine, info)
    engine.close()


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf: Path, omni_cache_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(converted_folder(smollm2_gguf, omni_cache_dir))
