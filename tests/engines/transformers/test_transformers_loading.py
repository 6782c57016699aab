"""The transformers engine's loading and settings: a GGUF converted once, dummy
weights of a tiny shape, engine_args refused by name, its declared contract."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import kernels
from services.engines.base import EngineSettings, FinishOutput, KvGeometry, SamplingParams
from services.engines.registry import engine_class, settings_model
from services.engines.transformers import TransformersEngine
from services.engines.transformers.config import TransformersArgs
from services.engines.transformers.loading import converted_folder, kernels_refuse
from services.mesh.errors import InitFailed
from services.testing.configs import TINY_LLAMA
from services.testing.engine_runs import generate
from tests.helpers.text_engine import Tiny, collect, req


def test_registry_names_the_engine_and_its_settings() -> None:
    assert engine_class("transformers") is TransformersEngine
    assert settings_model("transformers") is TransformersArgs


def test_second_gguf_load_reuses_the_conversion(
    smollm2_engine: TransformersEngine, smollm2_gguf: Path, omni_cache_dir: Path
) -> None:
    folder = converted_folder(smollm2_gguf, omni_cache_dir)  # the engine converted it
    # The parent's mtime moves if a conversion so much as creates a temp folder.
    watched = [folder.parent, folder, *folder.iterdir()]
    before = [p.stat().st_mtime_ns for p in watched]
    again = TransformersEngine(EngineSettings(cache_dir=omni_cache_dir))
    try:
        info = again.load(smollm2_gguf)
    finally:
        again.close()
    assert [p.stat().st_mtime_ns for p in watched] == before
    assert info.kv == KvGeometry(layers=30, kv_heads=3, head_dim=64, dtype_bytes=4)
    # The default (weights: auto) runs the linears from the file's blocks where the
    # kernels run here: 5 bits a Q4_1 weight, 9 a Q8_0 one (the output projection, tied
    # to the float32 input embeddings, which stay); float32 packed for oneDNN where not.
    embeddings = 49152 * 576 * 4
    if kernels_refuse() is None:
        assert "211 linears on GGUF blocks" in info.description
        assert f"kernels {kernels.variant()}" in info.compute
        assert embeddings + 100e6 * 5 / 8 < info.model_bytes < embeddings + 140e6 * 9 / 8
    else:
        assert info.description.endswith("211 packed for oneDNN")
        assert embeddings + 130e6 * 4 < info.model_bytes < embeddings + 140e6 * 4 + embeddings
    assert not list(folder.parent.glob(f".{folder.name}.*")), "a temp folder was left behind"


async def test_dummy_weights_give_a_tiny_model_with_the_real_tokenizer(
    tiny_smollm2: Tiny, smollm2_engine: TransformersEngine
) -> None:
    assert tiny_smollm2.info.kv == KvGeometry(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)
    # Mostly the 49152-row embedding, twice: the tied output projection's packed copy.
    assert tiny_smollm2.info.model_bytes < 32 * 2**20
    text = "What is the capital of France?"
    params = SamplingParams(temperature=0.0, max_tokens=4)  # seeded weights: no stray EOS
    small = await collect(generate(tiny_smollm2.engine, req(text=text, params=params)))
    one = SamplingParams(max_tokens=1)
    real = await collect(generate(smollm2_engine, req(text=text, params=one)))
    assert small.finish == FinishOutput("length", real.finish.prompt_tokens, 4)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("settings", "field", "complaint"),
    [
        (
            EngineSettings(engine_args={"dtyp": "float32"}),
            "engine_args.dtyp",
            "unknown key; expected one of defaults,",
        ),
        (EngineSettings(dtype="float64"), "dtype", "'float64' is not one of"),
        (
            EngineSettings(engine_args={"defaults": {"max_token": 4}}),
            "engine_args.defaults.max_token",
            "unknown key; expected one of max_tokens, temperature, top_p, top_k",
        ),
        (
            EngineSettings(engine_args={"config_overrides": TINY_LLAMA}),
            "engine_args.config_overrides",
            "needs load_format: dummy",
        ),
        (
            EngineSettings(engine_args={"prefill_tokens": True}),
            "engine_args.prefill_tokens",
            "expected a number, not true/false",
        ),
    ],
)
def test_bad_engine_args_fail_at_construction_naming_the_key(
    settings: EngineSettings, field: str, complaint: str
) -> None:
    with pytest.raises(InitFailed) as caught:
        TransformersEngine(settings)
    assert caught.value.field == field
    assert caught.value.message.startswith(f"{field}: {complaint}")


def test_engine_declares_its_contract() -> None:
    assert TransformersEngine.name == "transformers"
    assert TransformersEngine.output_tensors == ("hidden_states",)
    assert "seed" in TransformersEngine.supported_params
    assert "num_inference_steps" not in TransformersEngine.supported_params
