"""The prompt bound of the transformers engine on the real SmolLM2 tokenizer: sound
(no token covers more text than it assumes) and applied before tokenizing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.engines.base import EngineRequest, EngineSettings
from services.engines.prompt_size import SAFETY, longest_token_chars
from services.engines.transformers import TransformersEngine
from services.mesh.errors import InvalidArgument
from services.testing.configs import TINY_LLAMA

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def engine(smollm2_gguf: Path, omni_cache_dir: Path) -> Iterator[TransformersEngine]:
    settings = EngineSettings(
        load_format="dummy",
        max_prompt_tokens=MAX_TOKENS,
        cache_dir=omni_cache_dir,
        engine_args={"config_overrides": TINY_LLAMA},
    )
    engine = TransformersEngine(settings)
    engine.load(smollm2_gguf)
    yield engine
    engine.close()


def test_no_token_covers_more_text_than_the_bound_assumes(engine: TransformersEngine) -> None:
    tokenizer = engine.tokenizer
    longest = longest_token_chars(tokenizer)
    covered = [len(tokenizer.decode([token_id]).encode()) for token_id in range(len(tokenizer))]
    assert max(covered) <= longest
    for text in ("x" * 5000, "-" * 5000, " " * 5000, "\n" * 5000, "héllo wörld ✓ " * 300):
        assert len(text) <= len(tokenizer(text)["input_ids"]) * longest


def refused(engine: TransformersEngine, **inputs: object) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as caught:
        engine.check(EngineRequest("r", **inputs))  # type: ignore[arg-type]
    return caught.value


def test_each_kind_of_prompt_is_measured_before_it_is_tokenized(
    engine: TransformersEngine,
) -> None:
    most = MAX_TOKENS * longest_token_chars(engine.tokenizer) * SAFETY
    error = refused(engine, text="x" * (most + 1))
    assert error.field == "inputs.text" and "without tokenizing" in error.message
    error = refused(engine, messages=(("user", "x" * most),))
    assert error.field == "inputs.messages" and "without tokenizing" in error.message
    error = refused(engine, token_ids=tuple(range(MAX_TOKENS + 1)))
    assert error.field == "inputs.token_ids" and f"limit is {MAX_TOKENS}" in error.message
    rows = torch.zeros(MAX_TOKENS + 1, TINY_LLAMA["hidden_size"])
    error = refused(engine, tensors={"prompt_embeds": rows})
    assert "embedding rows" in error.message
    # Under the character bound, the token count still decides, after tokenizing.
    error = refused(engine, text=" word" * (MAX_TOKENS + 1))
    assert f"{MAX_TOKENS + 1} tokens, the limit is {MAX_TOKENS}" in error.message
    engine.check(EngineRequest("ok", text=" word" * MAX_TOKENS))
